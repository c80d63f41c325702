#!/bin/bash
# A launch that quotes an array whose elements hold "--flag value" pairs: each pair reaches
# Megatron-LM as one word and its argparse stops (unrecognized arguments). Written for aihpc.
MODEL_ARGS=(
    "--num-layers 32"
    "--hidden-size 4096"
    "--num-attention-heads 32"
)
torchrun --nproc_per_node 8 pretrain_gpt.py "${MODEL_ARGS[@]}" --seq-length 4096 \
    --vocab-size 32000 --micro-batch-size 1 --global-batch-size 32 --lr 1e-4 --bf16
