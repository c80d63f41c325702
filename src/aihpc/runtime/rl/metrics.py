"""Prometheus figures of a GRPO run, written for node-exporter's textfile collector: rank 0
rewrites ``RUN_DIR/metrics.prom`` (atomically, prometheus-client's ``write_to_textfile``) after
every step. Labels ``hpc_job`` (observe.metrics.job_name) and ``rank``, as the trainer's.

    aihpc_rl_step                          the GRPO step the policy is at
    aihpc_rl_phase_seconds_total{phase}    rollout | logprob | update | weight_sync
    aihpc_rl_rollout_tokens_per_second     the last rollout's generated tokens / its seconds
    aihpc_rl_reward_mean                   the last step's mean reward (all ranks' samples)
    aihpc_rl_response_length_tokens        the last step's mean response length
    aihpc_rl_kl                            the last update's mean KL to the reference
    aihpc_rl_staleness_steps               steps the rollouts were behind the policy (0: on-policy)
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, write_to_textfile

from aihpc.observe.metrics import job_name

__all__ = ["PHASES", "RLMetrics"]

PHASES = ("rollout", "logprob", "update", "weight_sync")


class RLMetrics:
    def __init__(self, run_dir: Path, rank: int = 0) -> None:
        self.path = run_dir / "metrics.prom"
        self.registry = CollectorRegistry()
        base = {"hpc_job": job_name(run_dir), "rank": str(rank)}
        names = list(base)

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, names, registry=self.registry).labels(**base)

        self.step = gauge("aihpc_rl_step", "The GRPO step the policy is at")
        self.tokens_per_s = gauge("aihpc_rl_rollout_tokens_per_second", "Rollout tokens / s")
        self.reward = gauge("aihpc_rl_reward_mean", "Mean reward of the last step's samples")
        self.length = gauge("aihpc_rl_response_length_tokens", "Mean response length")
        self.kl = gauge("aihpc_rl_kl", "Mean KL to the reference in the last update")
        self.staleness = gauge("aihpc_rl_staleness_steps", "Steps the rollouts lag the policy")
        phases = Counter(
            "aihpc_rl_phase_seconds", "GRPO step time by phase", [*names, "phase"],
            registry=self.registry,
        )  # fmt: skip
        self.phases = {p: phases.labels(**base, phase=p) for p in PHASES}

    def record(self, m: dict) -> None:
        """One step's metrics line (GRPOTrainer.train_step's) into the figures and the file."""
        self.step.set(m["step"])
        for p in PHASES:
            self.phases[p].inc(m[f"{p}_s"])
        if m["rollout_s"] > 0:
            self.tokens_per_s.set(m["rollout_tokens"] / m["rollout_s"])
        self.reward.set(m["reward"])
        self.length.set(m["response_len"])
        self.kl.set(m["kl"])
        self.staleness.set(m.get("staleness", 0))  # versions the oldest sample was behind
        write_to_textfile(str(self.path), self.registry)
