#!/bin/bash
# A 64-expert fine-grained MoE (top-6) on 16 nodes with the flex dispatcher over DeepEP, EP 16,
# written for aihpc's import corpus in the style of Megatron-LM's MoE recipes of 2026.
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export NVTE_FWD_LAYERNORM_SM_MARGIN=${NVTE_FWD_LAYERNORM_SM_MARGIN:-16}

: ${NNODES:=16}
: ${GPUS_PER_NODE:=8}
: ${DISPATCHER:=flex}
MBS=1
GBS=$((NNODES * GPUS_PER_NODE * 2))

declare -a ARGS=(
    --num-layers 24 --hidden-size 2048 --ffn-hidden-size 10944
    --num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096
    --position-embedding-type rope --rotary-base 10000 --swiglu
    --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear
    --vocab-size 102400
)
ARGS+=(--num-experts 64 --moe-ffn-hidden-size 1408 --moe-router-topk 6 --moe-grouped-gemm)
case "$DISPATCHER" in
    flex)
        ARGS+=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep) ;;
    alltoall|a2a)
        ARGS+=(--moe-token-dispatcher-type alltoall) ;;
    *)
        echo "unknown dispatcher $DISPATCHER"; exit 2 ;;
esac
ARGS+=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --expert-model-parallel-size 16
    --micro-batch-size $MBS --global-batch-size $GBS
    --bf16 --use-distributed-optimizer --overlap-grad-reduce
    --lr 4.2e-4 --min-lr 4.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --train-iters 100000 --clip-grad 1.0 --weight-decay 0.1
    --recompute-granularity selective --recompute-modules moe_act layernorm
)

srun --nodes "$NNODES" --ntasks-per-node 1 --export=ALL \
    torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-localhost}:29500" \
    pretrain_gpt.py "${ARGS[@]}"
