#!/usr/bin/env bash
# Llama-2 family pre-training on 2 nodes; pick the size with MODEL_SIZE.
set -e

MODEL_SIZE=${MODEL_SIZE:-13B}

DATA_PATH=/lustre/data/redpajama/rp_text_document
TOKENIZER=/lustre/models/llama2/tokenizer.model
CKPT_DIR=/lustre/ckpt/llama2-${MODEL_SIZE}

case "$MODEL_SIZE" in
    7B)
        NUM_LAYERS=32
        HIDDEN_SIZE=4096
        FFN_HIDDEN_SIZE=11008
        NUM_HEADS=32
        TP=1
        ;;
    13B)
        NUM_LAYERS=40
        HIDDEN_SIZE=5120
        FFN_HIDDEN_SIZE=13824
        NUM_HEADS=40
        TP=2
        ;;
    70B)
        NUM_LAYERS=80
        HIDDEN_SIZE=8192
        FFN_HIDDEN_SIZE=28672
        NUM_HEADS=64
        TP=8
        ;;
    *)
        echo "unknown MODEL_SIZE $MODEL_SIZE" >&2
        exit 1
        ;;
esac

SEQ_LEN=4096
MICRO_BATCH=2
GLOBAL_BATCH=512

NNODES=2
GPUS_PER_NODE=8

torchrun --nnodes $NNODES --nproc_per_node $GPUS_PER_NODE \
    --rdzv_backend c10d --rdzv_endpoint ${MASTER_ADDR:-localhost}:29400 \
    pretrain_gpt.py \
    --tensor-model-parallel-size $TP \
    --pipeline-model-parallel-size 1 \
    --num-layers $NUM_LAYERS \
    --hidden-size $HIDDEN_SIZE \
    --ffn-hidden-size $FFN_HIDDEN_SIZE \
    --num-attention-heads $NUM_HEADS \
    --seq-length $SEQ_LEN \
    --max-position-embeddings $SEQ_LEN \
    --micro-batch-size $MICRO_BATCH \
    --global-batch-size $GLOBAL_BATCH \
    --position-embedding-type rope \
    --normalization RMSNorm \
    --swiglu \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --bf16 \
    --use-distributed-optimizer \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --train-iters 100000 \
    --tokenizer-type Llama2Tokenizer \
    --tokenizer-model $TOKENIZER \
    --data-path $DATA_PATH \
    --save $CKPT_DIR --load $CKPT_DIR \
    --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10
