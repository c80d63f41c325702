#!/bin/bash
# 30 layers on 4 pipeline stages, the first and last holding 6 (the embedding and the loss take
# the rest), as current Megatron-LM expresses uneven stages. Written for aihpc's import corpus.
STAGE_ARGS=(--pipeline-model-parallel-size 4)
STAGE_ARGS+=(--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6)
torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py \
    --num-layers 30 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 \
    --max-position-embeddings 4096 --vocab-size 32000 --swiglu \
    --normalization RMSNorm --position-embedding-type rope \
    "${STAGE_ARGS[@]}" --tensor-model-parallel-size 2 --sequence-parallel \
    --micro-batch-size 1 --global-batch-size 128 --train-iters 5000 --lr 3e-4 --bf16 \
    --use-distributed-optimizer
