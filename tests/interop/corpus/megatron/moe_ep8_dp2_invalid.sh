#!/bin/bash
# An 8-expert MoE on 2 nodes with TP 4 and EP 8: Megatron-LM refuses it (ETP x EP x PP = 32
# does not divide the 16 GPUs). Written for aihpc's import corpus.
NNODES=2
torchrun --nnodes $NNODES --nproc-per-node 8 pretrain_gpt.py \
    --num-layers 16 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --seq-length 4096 --max-position-embeddings 4096 --vocab-size 32000 --swiglu \
    --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall \
    --tensor-model-parallel-size 4 --sequence-parallel --expert-model-parallel-size 8 \
    --micro-batch-size 1 --global-batch-size 64 --train-iters 1000 --lr 1e-4 --bf16
