#!/bin/bash
# Llama-2 70B pre-training with Megatron-Core, 8 nodes x 8 H100.
# Usage: bash llama2_70b_64gpu.sh <checkpoint dir> <tokenizer.model> <data prefix>

set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_IB_SL=1
export TORCH_NCCL_AVOID_RECORD_STREAMS=1

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3

GPUS_PER_NODE=8
NNODES=8
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NODE_RANK=${NODE_RANK:-0}

TP=8
PP=4

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 80
    --hidden-size 8192
    --ffn-hidden-size 28672
    --num-attention-heads 64
    --group-query-attention
    --num-query-groups 8
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --no-masked-softmax-fusion
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1024
    --train-iters 250000
    --lr 1.5e-4
    --min-lr 1.5e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --init-method-std 0.02
    --bf16
    --use-flash-attn
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP
    --pipeline-model-parallel-size $PP
    --sequence-parallel
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model $TOKENIZER_MODEL
    --split 99,1,0
)

LOGGING_ARGS=(
    --log-interval 10
    --save-interval 2000
    --eval-interval 2000
    --eval-iters 20
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --log-throughput
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${LOGGING_ARGS[@]}"
