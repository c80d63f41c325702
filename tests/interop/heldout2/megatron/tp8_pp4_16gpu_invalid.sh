#!/bin/bash
# 2 nodes; someone copied the TP/PP of a 4-node recipe.
export CUDA_DEVICE_MAX_CONNECTIONS=1

NNODES=2
GPUS_PER_NODE=8

torchrun --nnodes=$NNODES --nproc-per-node=$GPUS_PER_NODE \
    --rdzv-backend=c10d --rdzv-endpoint=${MASTER_ADDR:-localhost}:29500 \
    pretrain_gpt.py \
    --tensor-model-parallel-size 8 \
    --pipeline-model-parallel-size 4 \
    --num-layers 80 \
    --hidden-size 8192 \
    --ffn-hidden-size 28672 \
    --num-attention-heads 64 \
    --group-query-attention \
    --num-query-groups 8 \
    --seq-length 4096 \
    --max-position-embeddings 4096 \
    --position-embedding-type rope \
    --swiglu \
    --normalization RMSNorm \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --micro-batch-size 1 \
    --global-batch-size 512 \
    --bf16 \
    --use-distributed-optimizer \
    --sequence-parallel \
    --tokenizer-type Llama2Tokenizer \
    --tokenizer-model /models/llama2/tokenizer.model \
    --data-path /data/slimpajama_text_document \
    --train-iters 100000 --lr 1.5e-4 --lr-decay-style cosine \
    --log-interval 10
