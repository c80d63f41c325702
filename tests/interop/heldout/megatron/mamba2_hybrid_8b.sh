#!/bin/bash
# Mamba-2 hybrid 8B (Nemotron-H style layer pattern), 2 nodes (held-out file).
GPUS_PER_NODE=8
NUM_NODES=${NUM_NODES:-2}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-/models/tokenizer.model}

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES --master_addr ${MASTER_ADDR:-localhost} --master_port 6000"

MAMBA_ARGS=(
    --num-layers 56
    --hybrid-attention-ratio 0.08
    --hybrid-mlp-ratio 0.5
    --hidden-size 4096
    --ffn-hidden-size 16384
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --mamba-state-dim 128
    --mamba-head-dim 64
    --mamba-num-groups 8
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type none
    --normalization RMSNorm
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec
)

torchrun $DISTRIBUTED_ARGS pretrain_mamba.py \
    "${MAMBA_ARGS[@]}" \
    --tensor-model-parallel-size 2 \
    --micro-batch-size 1 --global-batch-size 256 \
    --train-iters 100000 --lr 2.5e-4 --min-lr 2.5e-6 --lr-decay-style cosine \
    --bf16 --use-distributed-optimizer \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model $TOKENIZER_MODEL \
    --mock-data
