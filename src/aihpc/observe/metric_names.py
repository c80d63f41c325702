"""The names, types and labels of the trainer's Prometheus metrics: one table that the exporter
(``metrics.py``), the dashboard and the docs' metrics table are checked against."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "LABELS",
    "MEMORY_KINDS",
    "METRICS",
    "PHASES",
    "RL_METRICS",
    "MetricDef",
    "metric_names",
    "rl_metric_names",
]

# hpc_job, gpu, UUID and Hostname are dcgm-exporter's names (aihpc.observe.gpu_labels), so the
# two join; node (the host name) is kept for the queries written against it.
LABELS = ("hpc_job", "rank", "node", "gpu", "UUID", "Hostname")
PHASES = ("data_wait", "forward_backward", "optimizer", "loss_sync", "checkpoint_blocking")
MEMORY_KINDS = ("host_rss", "device_allocated", "device_reserved", "device_peak_allocated")


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()  # beyond LABELS


METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "aihpc_train_info",
        "gauge",
        "1, labelled with the run spec's facts",
        ("model", "spec_gpu", "world_size", "plan"),  # gpu is dcgm-exporter's GPU index
    ),
    MetricDef("aihpc_train_steps_total", "counter", "Optimizer steps this process completed"),
    MetricDef("aihpc_train_step", "gauge", "The step the model is at (counts from the resume)"),
    MetricDef("aihpc_train_step_duration_seconds", "histogram", "Wall time of one step"),
    MetricDef(
        "aihpc_train_phase_seconds_total",
        "counter",
        "Step time by phase (data_wait is the input pipeline's)",
        ("phase",),
    ),
    MetricDef("aihpc_train_tokens_total", "counter", "Tokens this rank trained on"),
    MetricDef("aihpc_train_tokens_per_second", "gauge", "This rank's tokens/s, last step"),
    MetricDef(
        "aihpc_train_mfu_ratio", "gauge", "Model FLOPs/s over the spec GPU's peak, last step"
    ),
    MetricDef("aihpc_train_loss", "gauge", "Training loss, last step (mean over ranks)"),
    MetricDef("aihpc_train_grad_norm", "gauge", "Global gradient norm before clipping"),
    MetricDef("aihpc_train_learning_rate", "gauge", "Learning rate of the last step"),
    MetricDef("aihpc_train_memory_bytes", "gauge", "Memory in use", ("kind",)),
    MetricDef("aihpc_train_checkpoint_blocking_seconds", "histogram", "Training paused by a save"),
    MetricDef("aihpc_train_checkpoint_save_seconds", "histogram", "Save start to commit"),
    MetricDef("aihpc_train_checkpoint_load_seconds", "gauge", "Checkpoint load at (re)start"),
    MetricDef(
        "aihpc_train_checkpoint_written_bytes_total",
        "counter",
        "Checkpoint bytes committed (counted by rank 0, which commits)",
    ),
    MetricDef("aihpc_train_last_committed_step", "gauge", "Step of the newest committed save"),
    MetricDef("aihpc_train_restarts_total", "counter", "Restarts of the job so far"),
    MetricDef("aihpc_train_hangs_total", "counter", "Hangs this rank's watchdog detected"),
    MetricDef(
        "aihpc_train_finished",
        "gauge",
        "1 once this process ended its training cleanly, 0 before (an end marker for alerts)",
    ),
    MetricDef("aihpc_train_job_start_timestamp_seconds", "gauge", "Start of this launch (unix)"),
    MetricDef("aihpc_train_last_step_timestamp_seconds", "gauge", "End of the last step (unix)"),
    MetricDef("aihpc_train_ettr_ratio", "gauge", "Effective training time ratio since the launch"),
    MetricDef("aihpc_train_predicted_step_seconds", "gauge", "aihpc estimate's step time"),
    MetricDef(
        "aihpc_train_predicted_tokens_per_second", "gauge", "aihpc estimate's tokens/s per GPU"
    ),
    MetricDef("aihpc_train_predicted_mfu_ratio", "gauge", "aihpc estimate's MFU"),
    MetricDef("aihpc_train_predicted_memory_bytes", "gauge", "aihpc estimate's memory per GPU"),
    MetricDef("aihpc_train_predicted_ettr_ratio", "gauge", "aihpc goodput's ETTR"),
)


# `aihpc rl train`'s figures (runtime/rl/metrics.py and observe.py), which rank 0 writes to the
# run directory's metrics.prom for node-exporter's textfile collector; labels hpc_job and rank.
RL_METRICS: tuple[MetricDef, ...] = (
    MetricDef("aihpc_rl_step", "gauge", "The GRPO step the policy is at"),
    MetricDef(
        "aihpc_rl_phase_seconds",
        "counter",
        "GRPO step time by phase: rollout, logprob, update, weight_sync",
        ("phase",),
    ),
    MetricDef(
        "aihpc_rl_phase_last_seconds",
        "gauge",
        "The last step's seconds by phase: rollout, logprob, reward, update, weight_sync",
        ("phase",),
    ),
    MetricDef(
        "aihpc_rl_predicted_phase_seconds",
        "gauge",
        "aihpc rl estimate's seconds by phase for the run's spec on this machine",
        ("phase",),
    ),
    MetricDef("aihpc_rl_rollout_tokens_per_second", "gauge", "Last rollout's tokens / seconds"),
    MetricDef("aihpc_rl_reward_mean", "gauge", "Mean reward of the last step's samples"),
    MetricDef("aihpc_rl_response_length_tokens", "gauge", "Mean response length, last step"),
    MetricDef("aihpc_rl_kl", "gauge", "Mean KL to the reference in the last update"),
    MetricDef("aihpc_rl_staleness_steps", "gauge", "Steps the rollouts lagged the policy"),
)


def rl_metric_names() -> set[str]:
    """Every series name ``aihpc rl train`` writes (a counter's _total and _created)."""
    names = set()
    for d in RL_METRICS:
        names |= {f"{d.name}_total", f"{d.name}_created"} if d.kind == "counter" else {d.name}
    return names


def metric_names() -> set[str]:
    """Every series name the exporter can produce (histograms' _bucket, _sum and _count)."""
    names = set()
    for d in METRICS:
        if d.kind == "histogram":
            names |= {f"{d.name}_bucket", f"{d.name}_sum", f"{d.name}_count"}
        else:
            names.add(d.name)
    return names
