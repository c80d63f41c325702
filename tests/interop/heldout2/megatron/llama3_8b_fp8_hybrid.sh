#!/bin/bash
# Llama 3 8B, FP8 (delayed scaling, hybrid E4M3/E5M2) on 2 x 8 H100

export CUDA_DEVICE_MAX_CONNECTIONS=1
export NVTE_FWD_LAYERNORM_SM_MARGIN=16
export NVTE_BWD_LAYERNORM_SM_MARGIN=16

DATA_PATH=${DATA_PATH:-/data/fineweb/fineweb_text_document}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-/checkpoints/llama3_8b_fp8}

GPUS_PER_NODE=8
NUM_NODES=2

MODEL_ARGS="
    --use-mcore-models \
    --transformer-impl transformer_engine \
    --num-layers 32 \
    --hidden-size 4096 \
    --ffn-hidden-size 14336 \
    --num-attention-heads 32 \
    --group-query-attention \
    --num-query-groups 8 \
    --kv-channels 128 \
    --seq-length 8192 \
    --max-position-embeddings 8192 \
    --position-embedding-type rope \
    --rotary-base 500000 \
    --rotary-percent 1.0 \
    --swiglu \
    --normalization RMSNorm \
    --norm-epsilon 1e-5 \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --attention-dropout 0.0 \
    --hidden-dropout 0.0
"

PRECISION_ARGS="
    --bf16 \
    --fp8-format hybrid \
    --fp8-amax-history-len 1024 \
    --fp8-amax-compute-algo max
"

TRAIN_ARGS="
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 1 \
    --sequence-parallel \
    --micro-batch-size 1 \
    --global-batch-size 128 \
    --train-iters 50000 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1000 \
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 \
    --use-distributed-optimizer \
    --overlap-grad-reduce \
    --overlap-param-gather
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --tokenizer-type HuggingFaceTokenizer \
    --tokenizer-model meta-llama/Meta-Llama-3-8B \
    --split 99,1,0
"

torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES \
    --node_rank ${NODE_RANK:-0} --master_addr ${MASTER_ADDR:-localhost} --master_port 6000 \
    pretrain_gpt.py $MODEL_ARGS $PRECISION_ARGS $TRAIN_ARGS $DATA_ARGS \
    --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH \
    --log-interval 10 --save-interval 5000 --eval-interval 1000 --eval-iters 10
