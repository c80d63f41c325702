#!/bin/bash
# Llama-3.1 8B long-context continued pretraining: 16k tokens, TP 2 x CP 2 on 2 nodes (held-out file).
GPUS_PER_NODE=8
NNODES=${NNODES:-2}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))
TOKENIZER=${TOKENIZER:-meta-llama/Llama-3.1-8B}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --master_addr ${MASTER_ADDR:-localhost}
    --master_port ${MASTER_PORT:-6000}
)

MODEL_ARGS=(
    --use-mcore-models
    --transformer-impl transformer_engine
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length 16384
    --max-position-embeddings 131072
    --position-embedding-type rope
    --rotary-base 500000
    --use-rope-scaling
    --normalization RMSNorm
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 64
    --train-iters 2000
    --lr 3e-5
    --lr-decay-style constant
    --bf16
    --attention-backend fused
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --context-parallel-size 2
    --cp-comm-type p2p
    --sequence-parallel
    --use-distributed-optimizer
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${PARALLEL_ARGS[@]}" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model $TOKENIZER \
    --mock-data --log-interval 5 --eval-iters 0
