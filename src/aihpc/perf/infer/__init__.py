"""Inference and RL-rollout pricing on the training model's specs (no torch): prefill, decode,
the KV cache and the largest batch that fits, serving parallelism (TP / PP / DP / EP),
continuous batching, chunked prefill, disaggregated prefill and decode, a search over
serving plans, and the rollout phase of an RL step. docs/inference.md has the formulas."""

from aihpc.perf.infer.estimate import InferenceEstimate, estimate_inference
from aihpc.perf.infer.kv import ServingPlan, kv_bytes_per_token
from aihpc.perf.infer.memory import InferenceMemory
from aihpc.perf.infer.rollout import LengthDist, RolloutEstimate, estimate_rollout
from aihpc.perf.infer.search import search_serving
from aihpc.perf.infer.serving import Load, ServingEstimate, disaggregated, steady_state

__all__ = [
    "InferenceEstimate",
    "InferenceMemory",
    "LengthDist",
    "Load",
    "RolloutEstimate",
    "ServingEstimate",
    "ServingPlan",
    "disaggregated",
    "estimate_inference",
    "estimate_rollout",
    "kv_bytes_per_token",
    "search_serving",
    "steady_state",
]
