"""The RL post-training planner: one RL step (GRPO, RLOO, PPO) priced as named phases:
rollout (``rollout``, by perf/infer's rollout estimate), log-probs, reward, training, weight
sync and the colocated switch (``phases``), put together on the critical path (``step``), and
the search over the GPU split and both parallelisms (``search``). Never imports torch."""

from aihpc.perf.rl.step import RLEstimate, estimate_rl

__all__ = ["RLEstimate", "estimate_rl"]
