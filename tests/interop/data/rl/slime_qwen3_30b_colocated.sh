#!/bin/bash
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/qwen3-30B-A3B.sh"
ROLLOUT_ARGS=(
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --global-batch-size 256
)
PERF_ARGS=(
   --tensor-model-parallel-size 4
   --sequence-parallel
   --expert-model-parallel-size 8
   --recompute-granularity full
)
GRPO_ARGS=(--advantage-estimator grpo --use-kl-loss)
SGLANG_ARGS=(--rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7)
ray job submit --address="http://127.0.0.1:8265" -- python3 train.py \
   --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate \
   ${MODEL_ARGS[@]} ${ROLLOUT_ARGS[@]} ${PERF_ARGS[@]} ${GRPO_ARGS[@]} ${SGLANG_ARGS[@]}
