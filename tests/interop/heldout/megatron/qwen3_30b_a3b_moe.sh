#!/bin/bash
# Qwen3-30B-A3B MoE pretraining, 4 nodes x 8 GPUs: TP 2, PP 2, EP 8 (held-out file).
set -e
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-4}
PRECISION=${PRECISION:-bf16}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-Qwen/Qwen3-30B-A3B}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr ${MASTER_ADDR:-localhost}
    --master_port ${MASTER_PORT:-6000}
)

MODEL_ARGS=(
    --use-mcore-models
    --transformer-impl transformer_engine
    --num-layers 48
    --hidden-size 2048
    --ffn-hidden-size 6144
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 4
    --kv-channels 128
    --qk-layernorm
    --seq-length 4096
    --max-position-embeddings 40960
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

MOE_ARGS=(
    --num-experts 128
    --moe-router-topk 8
    --moe-ffn-hidden-size 768
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --moe-router-dtype fp32
    --moe-permute-fusion
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 512
    --train-iters 20000
    --lr 3e-4
    --min-lr 3e-5
    --lr-warmup-iters 500
    --lr-decay-style cosine
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
)

if [ "$PRECISION" == "fp8" ]; then
    TRAINING_ARGS+=(--fp8-format hybrid --fp8-recipe blockwise)
fi

PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --expert-model-parallel-size 8
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} ${MOE_ARGS[@]} ${TRAINING_ARGS[@]} ${PARALLEL_ARGS[@]} \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model ${TOKENIZER_MODEL} \
    --mock-data --log-interval 1 --eval-iters 0
