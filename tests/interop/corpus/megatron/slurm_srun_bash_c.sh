#!/bin/bash
#SBATCH --job-name=llama3-70b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
# Llama 3 70B on 4 nodes: srun starts one torchrun per node through `bash -c`, the launch
# line built in a string. Written for aihpc's import corpus.
export CUDA_DEVICE_MAX_CONNECTIONS=1
NNODES=${SLURM_NNODES:-4}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PARALLEL="--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --sequence-parallel"
MODEL="--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \
 --group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 \
 --position-embedding-type rope --rotary-base 500000 --swiglu --normalization RMSNorm \
 --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256"
TRAIN="--micro-batch-size 1 --global-batch-size 64 --train-iters 2000 --lr 1.5e-4 --bf16 \
 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
srun --container-image nvcr.io/nvidia/pytorch:25.11-py3 bash -c "torchrun \
  --nnodes $NNODES --nproc-per-node 8 --node-rank \$SLURM_NODEID \
  --rdzv-endpoint $MASTER_ADDR:29500 pretrain_gpt.py $MODEL $PARALLEL $TRAIN"
