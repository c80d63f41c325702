#!/bin/bash
# Long-context Llama 3 8B (32k) with context parallelism over 4 ranks, p2p (ring) K/V exchange.
# 4 nodes x 8 GPUs.

export CUDA_DEVICE_MAX_CONNECTIONS=1
export NVTE_FLASH_ATTN=1
export NVTE_FUSED_ATTN=0

GPUS_PER_NODE=8
NUM_NODES=4
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

CHECKPOINT_PATH=$1
DATA_PATH=$2

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT"

GPT_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length 32768
    --max-position-embeddings 32768
    --position-embedding-type rope
    --rotary-base 500000
    --swiglu
    --normalization RMSNorm
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --micro-batch-size 1
    --global-batch-size 64
    --lr 2e-5
    --min-lr 2e-6
    --lr-decay-style cosine
    --lr-warmup-iters 100
    --train-iters 2000
    --bf16
    --use-distributed-optimizer
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1
    --context-parallel-size 4
    --cp-comm-type p2p
    --sequence-parallel
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model meta-llama/Llama-3.1-8B
    --split 100,0,0
)

torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \
    "${GPT_ARGS[@]}" \
    "${PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --log-interval 10 \
    --save-interval 500 \
    --eval-interval 500 \
    --eval-iters 0
