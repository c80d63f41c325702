#!/bin/bash
# 12 layers over 8 pipeline stages with no layout: Megatron-LM refuses it. Written for aihpc.
PP=8
LAYERS=12
ARGS="--num-layers $LAYERS --hidden-size 2048 --num-attention-heads 16 --seq-length 2048"
ARGS="$ARGS --max-position-embeddings 2048 --vocab-size 50304"
torchrun --nproc_per_node 8 pretrain_gpt.py $ARGS \
    --pipeline-model-parallel-size $PP --micro-batch-size 1 --global-batch-size 64 \
    --train-iters 1000 --lr 3e-4 --bf16
