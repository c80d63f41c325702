#!/bin/bash
# BERT-large pretraining, in the style of Megatron-LM's examples/bert/train_bert_340m_distributed.sh.
# Written for aihpc's import corpus: a BERT (encoder) script that aihpc must refuse.
GPUS_PER_NODE=8
DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes 1)
BERT_MODEL_ARGS=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 512 --max-position-embeddings 512 --attention-backend auto
)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size 32 --train-iters 1000000 --fp16 --lr 0.0001)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_bert.py ${BERT_MODEL_ARGS[@]} ${TRAINING_ARGS[@]} \
    --vocab-file bert-vocab.txt --data-path my-bert_text_sentence
