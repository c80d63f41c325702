"""Inference and RL-rollout pricing on the training model's specs (no torch): prefill, decode,
the KV cache and the largest batch that fits, serving parallelism (TP / PP / DP / EP),
continuous batching, chunked prefill, disaggregated prefill and decode, a search over
serving plans, and the rollout phase of an RL step. docs/inference.md has the formulas."""

from aihpc.perf.infer.estimate import InferenceEstimate, estimate_inference
from aihpc.perf.infer.kv import ServingPlan, kv_bytes_per_token
from aihpc.perf.infer.memory import InferenceMemory

__all__ = [
    "InferenceEstimate",
    "InferenceMemory",
    "ServingPlan",
    "estimate_inference",
    "kv_bytes_per_token",
]
