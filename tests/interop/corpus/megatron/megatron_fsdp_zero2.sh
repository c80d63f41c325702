#!/bin/bash
# Llama 3 70B with Megatron-FSDP sharding optimizer state and gradients (ZeRO-2: optimizer state and gradients)
# on 8 nodes, TP 2. Written for aihpc's import corpus after Megatron-LM's Megatron-FSDP docs.
export CUDA_DEVICE_MAX_CONNECTIONS=8
NNODES=8
SHARDING=optim_grads

FSDP_ARGS=(
    --use-megatron-fsdp
    --data-parallel-sharding-strategy ${SHARDING}
    --no-gradient-accumulation-fusion
    --use-distributed-optimizer
    --ckpt-format fsdp_dtensor
    --init-model-with-meta-device
    --calculate-per-token-loss
    --grad-reduce-in-bf16
)

MODEL=(
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
    --group-query-attention --num-query-groups 8 --seq-length 8192
    --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000
    --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights
    --disable-bias-linear --vocab-size 128256 --tokenizer-type NullTokenizer
)

python -m torch.distributed.run --nproc-per-node 8 --nnodes $NNODES \
    pretrain_gpt.py "${MODEL[@]}" "${FSDP_ARGS[@]}" \
    --tensor-model-parallel-size 2 --sequence-parallel \
    --micro-batch-size 1 --global-batch-size 256 --train-iters 10000 \
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 200 \
    --bf16 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
