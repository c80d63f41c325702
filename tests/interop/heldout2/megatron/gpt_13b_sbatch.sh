#!/bin/bash
#SBATCH --job-name=gpt13b-pretrain
#SBATCH -N 4 --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out

export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_DEBUG=WARN

MEGATRON=/opt/Megatron-LM
DATA=/scratch/pile/pile_text_document
VOCAB=/scratch/gpt2/gpt2-vocab.json
MERGES=/scratch/gpt2/gpt2-merges.txt
CKPT=/scratch/ckpt/gpt13b

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

srun --kill-on-bad-exit=1 torchrun \
    --nnodes $SLURM_NNODES \
    --nproc_per_node 8 \
    --rdzv_id $SLURM_JOB_ID \
    --rdzv_backend c10d \
    --rdzv_endpoint ${head_node}:29500 \
    $MEGATRON/pretrain_gpt.py \
    --tensor-model-parallel-size 4 \
    --pipeline-model-parallel-size 2 \
    --sequence-parallel \
    --num-layers 40 \
    --hidden-size 5120 \
    --num-attention-heads 40 \
    --seq-length 2048 \
    --max-position-embeddings 2048 \
    --micro-batch-size 2 \
    --global-batch-size 256 \
    --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
    --train-iters 200000 \
    --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 \
    --use-distributed-optimizer \
    --data-path $DATA \
    --vocab-file $VOCAB \
    --merge-file $MERGES \
    --split 98,2,0 \
    --save $CKPT --load $CKPT \
    --log-interval 10 --save-interval 2000 --eval-interval 1000 --eval-iters 10
