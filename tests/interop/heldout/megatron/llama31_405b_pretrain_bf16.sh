#!/bin/bash
# Llama-3.1 405B, bf16, TP 8 x PP 7 on 56 nodes (held-out file).
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
NUM_NODES=${SLURM_NNODES:-56}
PRECISION=${PRECISION:-bf16}
MEGATRON_PATH=${MEGATRON_PATH:-/opt/megatron-lm}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --rdzv_id ${SLURM_JOB_ID:-405}
    --rdzv_backend c10d
    --rdzv_endpoint ${MASTER_ADDR:-localhost}:29500
)

GPT_MODEL_ARGS=(
    --use-mcore-models
    --transformer-impl transformer_engine
    --num-layers 126
    --hidden-size 16384
    --ffn-hidden-size 53248
    --num-attention-heads 128
    --group-query-attention
    --num-query-groups 8
    --seq-length 8192
    --max-position-embeddings 8192
    --position-embedding-type rope
    --rotary-base 500000
    --normalization RMSNorm
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1008
    --train-iters 100000
    --lr 8e-5
    --min-lr 8e-7
    --lr-warmup-iters 8000
    --lr-decay-style cosine
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
    --recompute-granularity full
    --recompute-method uniform
    --recompute-num-layers 1
)

if [ "$PRECISION" == "fp8" ]; then
    TRAINING_ARGS+=(--fp8-format hybrid --fp8-recipe delayed)
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 7
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
)

DATA_ARGS=(
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 128256
)

torchrun "${DISTRIBUTED_ARGS[@]}" ${MEGATRON_PATH}/pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    --log-interval 1 --save-interval 500 --eval-iters 0
