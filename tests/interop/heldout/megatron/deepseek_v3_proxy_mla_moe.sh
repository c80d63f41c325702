#!/bin/bash
# DeepSeek-V3-style proxy (MLA + 64 routed experts + 1 shared), 8 nodes: PP 4, EP 16 (held-out file).
export CUDA_DEVICE_MAX_CONNECTIONS=1
NNODES=${NNODES:-8}
GPUS_PER_NODE=8
TP_SIZE=${TP_SIZE:-1}
PP_SIZE=${PP_SIZE:-4}
EP_SIZE=${EP_SIZE:-16}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --rdzv_backend c10d
    --rdzv_endpoint ${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}
)

MODEL_ARGS=(
    --use-mcore-models
    --transformer-impl transformer_engine
    --num-layers 16
    --hidden-size 2048
    --ffn-hidden-size 10944
    --num-attention-heads 16
    --multi-latent-attention
    --q-lora-rank 1536
    --kv-lora-rank 512
    --qk-head-dim 128
    --qk-pos-emb-head-dim 64
    --v-head-dim 128
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --rotary-base 10000
    --normalization RMSNorm
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --vocab-size 129280
    --tokenizer-type NullTokenizer
)

MOE_ARGS=(
    --num-experts 64
    --moe-router-topk 6
    --moe-ffn-hidden-size 1408
    --moe-shared-expert-intermediate-size 1408
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 512
    --train-iters 10000
    --lr 4.2e-4
    --lr-warmup-iters 200
    --lr-decay-style cosine
    --bf16
    --mock-data
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --pipeline-model-parallel-size $PP_SIZE
    --expert-model-parallel-size $EP_SIZE
    --use-distributed-optimizer
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}"
