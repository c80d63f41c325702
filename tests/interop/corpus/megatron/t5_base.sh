#!/bin/bash
# T5 pretraining in the style of Megatron-LM's examples/t5 script: an encoder-decoder that aihpc
# must refuse. Written for aihpc's import corpus.
T5_ARGS="--encoder-num-layers 12 --decoder-num-layers 12 --hidden-size 768 \
--num-attention-heads 12 --kv-channels 64 --ffn-hidden-size 3072 --encoder-seq-length 512 \
--decoder-seq-length 128 --max-position-embeddings 512 --micro-batch-size 64 \
--global-batch-size 512 --lr 0.0001 --train-iters 1000000 --bf16"
torchrun --nproc_per_node 8 pretrain_t5.py $T5_ARGS --vocab-file bert-large-cased-vocab.txt
