#!/bin/bash
# Single node, Llama-2 7B, selective activation recomputation lets micro-batch 4 fit.

export CUDA_DEVICE_MAX_CONNECTIONS=1

TOKENIZER_MODEL=$1
DATA_PATH=$2

options=" \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 1 \
    --sequence-parallel \
    --num-layers 32 \
    --hidden-size 4096 \
    --ffn-hidden-size 11008 \
    --num-attention-heads 32 \
    --seq-length 4096 \
    --max-position-embeddings 4096 \
    --micro-batch-size 4 \
    --global-batch-size 256 \
    --recompute-granularity selective \
    --position-embedding-type rope \
    --normalization RMSNorm \
    --swiglu \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --train-iters 20000 \
    --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 200 \
    --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 \
    --use-distributed-optimizer \
    --tokenizer-type Llama2Tokenizer \
    --tokenizer-model ${TOKENIZER_MODEL} \
    --data-path ${DATA_PATH} \
    --split 949,50,1 \
    --log-interval 1 \
    --eval-interval 500 \
    --eval-iters 10"

torchrun --standalone --nproc_per_node 8 pretrain_gpt.py ${options}
