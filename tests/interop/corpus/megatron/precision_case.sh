#!/bin/bash
# Llama 3 8B where a `case` on PRECISION (set in the script) chooses the numerics; an `if` on
# RECOMPUTE chooses full recompute. Written for aihpc's import corpus.
export CUDA_DEVICE_MAX_CONNECTIONS=1
PRECISION=fp8
RECOMPUTE=${RECOMPUTE:-1}
NUMERICS=()
case "$PRECISION" in
    bf16) NUMERICS=(--bf16) ;;
    fp8|fp8-delayed) NUMERICS=(--bf16 --fp8-format hybrid --fp8-param-gather) ;;
    *) echo "unknown precision"; exit 1 ;;
esac
if [ "$RECOMPUTE" -eq 1 ]; then
    NUMERICS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
fi
torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py ${NUMERICS[@]} \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --seq-length 8192 \
    --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000 \
    --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights \
    --disable-bias-linear --vocab-size 128256 \
    --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 \
    --micro-batch-size 1 --global-batch-size 64 --train-iters 1000 --lr 3e-4 \
    --use-distributed-optimizer
