#!/bin/bash
# Mixtral-8x7B on 2 nodes with TP 2 and EP 16: the expert grid does not fit the world (held-out file).
GPUS_PER_NODE=8
NNODES=2

DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --master_addr localhost --master_port 6000)

MODEL_ARGS=(
    --use-mcore-models
    --transformer-impl transformer_engine
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length 4096
    --max-position-embeddings 32768
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --num-experts 8
    --moe-router-topk 2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" \
    --tensor-model-parallel-size 2 \
    --expert-model-parallel-size 16 \
    --sequence-parallel \
    --micro-batch-size 1 --global-batch-size 128 --train-iters 1000 --lr 1e-4 \
    --bf16 --use-distributed-optimizer \
    --tokenizer-type NullTokenizer --vocab-size 32000 --mock-data
