#!/bin/bash
# A 1.3B GPT on one node, data parallel only, with --sequence-parallel left on from a TP
# template (Megatron-LM turns it off at TP 1). Written for aihpc's import corpus.
export CUDA_DEVICE_MAX_CONNECTIONS=1
TP=1
OPTS="--micro-batch-size 4 --global-batch-size 256"
torchrun --standalone --nproc_per_node=8 pretrain_gpt.py \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 --vocab-size 50304 \
    --tensor-model-parallel-size $TP --sequence-parallel \
    $OPTS --train-iters 20000 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine \
    --lr-warmup-iters 200 --bf16 --use-distributed-optimizer --overlap-grad-reduce
