"""RL post-training, run for real: GRPO on the trainer's Llama (docs/rl.md, "Run").

``task`` the verifiable task (integer addition, exact answers, byte tokens), ``grpo`` the
advantages, log-probs and clipped loss with KL, ``rollout`` generation with the KV cache and
weight sync, ``trainer`` the loop on one rank (policy under a data-parallel plan, frozen
reference, colocated rollout model, checkpoints), ``pool`` and ``worker`` disaggregated rollout
(worker processes, weights broadcast over a gloo group, bounded staleness, restarts), ``run``
the command's run directory.
"""
