"""The training dashboard, generated with Grafana's foundation SDK (grafana-foundation-sdk, the
Grafana 11.6 schema). ``python -m aihpc.observe.dashboards.build`` rewrites
``aihpc-training.json`` beside this file; a test checks the committed JSON is this output.

Queries follow the exporter's conventions (``aihpc.observe.metric_names``): every rank exports
its share, so ``sum by (hpc_job)`` is the job's figure and ``avg by (hpc_job)`` the per-GPU one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gs
from grafana_foundation_sdk.builders import timeseries as gt
from grafana_foundation_sdk.builders.common import StackingConfig
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableRefresh,
)

__all__ = ["DCGM_ROW", "JSON_PATH", "PANELS", "RL_ROW", "Panel", "build"]

JSON_PATH = Path(__file__).with_name("aihpc-training.json")
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
J = '{hpc_job=~"$job"}'
RI = "[$__rate_interval]"
DCGM_ROW = "GPUs (dcgm-exporter)"
RL_ROW = "RL post-training (aihpc rl train)"


@dataclass(frozen=True)
class Panel:
    row: str
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    stacked: bool = False
    stat: bool = False


def _rate_mean(name: str, by: str = "hpc_job") -> str:
    """Mean of a histogram's observations over the rate window (sum / count)."""
    return f"sum by ({by}) (rate({name}_sum{J}{RI})) / sum by ({by}) (rate({name}_count{J}{RI}))"


def _job_gpus(dcgm: str, by: str = "hpc_job, rank") -> str:
    """dcgm-exporter's series of the GPUs the job's ranks run on, labelled with ``by``: joined on
    the GPU's UUID, which is the same inside and outside a job's device cgroup (an index may not
    be). One series per rank on the right, so ``group_left`` copies the rank's labels over.
    Ranks with no UUID (CPU runs, or a GPU not told for sure) are left out of the right side:
    two of them share the empty match group, and Prometheus refuses the whole query ("found
    duplicate series") as soon as any dcgm-exporter series is on the left."""
    ranks = J[:-1] + ', UUID!=""}'
    return (
        f"{dcgm} * on (UUID) group_left ({by}) "
        f"group by (UUID, {by}) (aihpc_train_job_start_timestamp_seconds{ranks})"
    )


PANELS: tuple[Panel, ...] = (
    Panel(
        "Throughput and efficiency",
        "Tokens/s: measured vs plan",
        "short",
        (
            (f"sum by (hpc_job) (rate(aihpc_train_tokens_total{J}{RI}))", "measured {{hpc_job}}"),
            (
                f"sum by (hpc_job) (aihpc_train_predicted_tokens_per_second{J})",
                "aihpc estimate {{hpc_job}}",
            ),
        ),
        "Whole job. The plan is aihpc estimate's tokens/s per GPU times the ranks running.",
    ),
    Panel(
        "Throughput and efficiency",
        "MFU: measured vs plan",
        "percentunit",
        (
            (f"avg by (hpc_job) (aihpc_train_mfu_ratio{J})", "measured {{hpc_job}}"),
            (f"avg by (hpc_job) (aihpc_train_predicted_mfu_ratio{J})", "aihpc estimate"),
        ),
        "Model FLOPs/s per GPU over the spec GPU's dense peak at the run's precision.",
    ),
    Panel(
        "Throughput and efficiency",
        "Step time: mean, p99 and plan",
        "s",
        (
            (_rate_mean("aihpc_train_step_duration_seconds"), "mean {{hpc_job}}"),
            (
                "histogram_quantile(0.99, sum by (le, hpc_job) "
                f"(rate(aihpc_train_step_duration_seconds_bucket{J}{RI})))",
                "p99 {{hpc_job}}",
            ),
            (f"avg by (hpc_job) (aihpc_train_predicted_step_seconds{J})", "aihpc estimate"),
        ),
    ),
    Panel(
        "Training",
        "Loss",
        "short",
        ((f"avg by (hpc_job) (aihpc_train_loss{J})", "{{hpc_job}}"),),
    ),
    Panel(
        "Training",
        "Gradient norm and learning rate",
        "short",
        (
            (f"avg by (hpc_job) (aihpc_train_grad_norm{J})", "grad norm {{hpc_job}}"),
            (f"avg by (hpc_job) (aihpc_train_learning_rate{J})", "lr {{hpc_job}}"),
        ),
    ),
    Panel(
        "Training",
        "Where the time goes (share of wall time)",
        "percentunit",
        ((f"avg by (phase) (rate(aihpc_train_phase_seconds_total{J}{RI}))", "{{phase}}"),),
        "Seconds per second in each phase, averaged over ranks; the gap to 100% is time outside "
        "steps (start-up, restarts, logging). data_wait is the input pipeline.",
        stacked=True,
    ),
    Panel(
        "Training",
        "Step time by rank (stragglers)",
        "s",
        ((_rate_mean("aihpc_train_step_duration_seconds", "rank"), "rank {{rank}}"),),
    ),
    Panel(
        "Training",
        "Memory per rank vs plan",
        "bytes",
        (
            (f"max by (kind) (aihpc_train_memory_bytes{J})", "{{kind}} (max over ranks)"),
            (f"max by (hpc_job) (aihpc_train_predicted_memory_bytes{J})", "aihpc estimate"),
        ),
        "The plan is per GPU; on a CPU run only host_rss is measured.",
    ),
    Panel(
        "Checkpoints and failures",
        "Checkpoint save (blocking, to commit) and load",
        "s",
        (
            (_rate_mean("aihpc_train_checkpoint_blocking_seconds"), "blocking {{hpc_job}}"),
            (_rate_mean("aihpc_train_checkpoint_save_seconds"), "to commit {{hpc_job}}"),
            (f"max by (hpc_job) (aihpc_train_checkpoint_load_seconds{J})", "load {{hpc_job}}"),
        ),
    ),
    Panel(
        "Checkpoints and failures",
        "Progress: step and last committed step",
        "short",
        (
            (f"max by (hpc_job) (aihpc_train_step{J})", "step {{hpc_job}}"),
            (f"min by (hpc_job) (aihpc_train_last_committed_step{J})", "committed {{hpc_job}}"),
        ),
        "The gap is the work a failure now would lose.",
    ),
    Panel(
        "Checkpoints and failures",
        "Checkpoint write bandwidth",
        "Bps",
        (
            (
                f"sum by (hpc_job) (rate(aihpc_train_checkpoint_written_bytes_total{J}{RI}))",
                "{{hpc_job}}",
            ),
        ),
    ),
    Panel(
        "Checkpoints and failures",
        "Restarts and hangs",
        "short",
        (
            (f"max by (hpc_job) (aihpc_train_restarts_total{J})", "restarts {{hpc_job}}"),
            (f"sum by (hpc_job) (aihpc_train_hangs_total{J})", "hangs {{hpc_job}}"),
        ),
    ),
    Panel(
        "Checkpoints and failures",
        "Goodput: ETTR so far vs aihpc goodput",
        "percentunit",
        (
            (f"min by (hpc_job) (aihpc_train_ettr_ratio{J})", "so far {{hpc_job}}"),
            (f"max by (hpc_job) (aihpc_train_predicted_ettr_ratio{J})", "aihpc goodput"),
        ),
        "Steps on the surviving trajectory x mean step time, over wall time since the launch.",
    ),
    Panel(
        "Checkpoints and failures",
        "Seconds since the last step",
        "s",
        ((f"time() - max by (hpc_job) (aihpc_train_last_step_timestamp_seconds{J})", ""),),
        "Alert on this: a hung job stops stepping long before NCCL's timeout fires.",
        stat=True,
    ),
    Panel(
        DCGM_ROW,
        "GPU utilisation by rank",
        "percent",
        ((_job_gpus("DCGM_FI_DEV_GPU_UTIL"), "rank {{rank}} (gpu {{gpu}} on {{Hostname}})"),),
        "dcgm-exporter's DCGM_FI_DEV_GPU_UTIL of each rank's GPU (needs dcgm-exporter scraped by "
        "the same Prometheus, and a GPU run: a CPU run's series carry no UUID).",
    ),
    Panel(
        DCGM_ROW,
        "GPU memory used (dcgm-exporter) vs plan",
        "bytes",
        (
            (
                f"max by (hpc_job) ({_job_gpus('DCGM_FI_DEV_FB_USED')}) * 1048576",
                "framebuffer used, max over ranks {{hpc_job}}",
            ),
            (f"max by (hpc_job) (aihpc_train_predicted_memory_bytes{J})", "aihpc estimate"),
        ),
        "DCGM_FI_DEV_FB_USED is in MiB and counts every process on the GPU (CUDA context "
        "included), so it sits above the allocator's figures.",
    ),
    Panel(
        DCGM_ROW,
        "Power and tokens per joule",
        "short",
        (
            (f"sum by (hpc_job) ({_job_gpus('DCGM_FI_DEV_POWER_USAGE')})", "watts {{hpc_job}}"),
            (
                f"sum by (hpc_job) (rate(aihpc_train_tokens_total{J}{RI})) / "
                f"sum by (hpc_job) ({_job_gpus('DCGM_FI_DEV_POWER_USAGE')})",
                "tokens/J {{hpc_job}}",
            ),
        ),
        "The job's GPUs' board power (DCGM_FI_DEV_POWER_USAGE, W) and tokens trained per joule.",
    ),
    Panel(
        DCGM_ROW,
        "GPU temperature and last XID by rank",
        "short",
        (
            (_job_gpus("DCGM_FI_DEV_GPU_TEMP"), "°C rank {{rank}}"),
            (_job_gpus("DCGM_FI_DEV_XID_ERRORS"), "XID rank {{rank}}"),
        ),
        "DCGM_FI_DEV_XID_ERRORS is the last XID the driver reported (0: none); aihpc doctor "
        "explains the codes.",
    ),
    Panel(
        RL_ROW,
        "RL phases: measured vs aihpc rl estimate",
        "s",
        (
            (f"max by (hpc_job, phase) (aihpc_rl_phase_last_seconds{J})", "{{phase}} measured"),
            (
                f"max by (hpc_job, phase) (aihpc_rl_predicted_phase_seconds{J})",
                "{{phase}} predicted",
            ),
        ),
        "The last GRPO step's seconds per phase (rollout, logprob, reward, update, weight_sync) "
        "beside aihpc rl estimate's for the run's own spec on this machine (its aihpc calibrate "
        "--local copy; absent without one). summary.json holds the same, as medians.",
    ),
    Panel(
        RL_ROW,
        "Where the RL step's time goes",
        "percentunit",
        (
            (
                f"sum by (hpc_job, phase) (rate(aihpc_rl_phase_seconds_total{J}{RI})) / "
                f"ignoring (phase) group_left sum by (hpc_job) "
                f"(rate(aihpc_rl_phase_seconds_total{J}{RI}))",
                "{{phase}}",
            ),
        ),
        "Each phase's share of the step over the rate window.",
        stacked=True,
    ),
    Panel(
        RL_ROW,
        "Rollout tokens/s",
        "short",
        ((f"sum by (hpc_job) (aihpc_rl_rollout_tokens_per_second{J})", "{{hpc_job}}"),),
        "Generated tokens of the last rollout over its seconds (rank 0 reports the job's).",
    ),
    Panel(
        RL_ROW,
        "Reward and KL",
        "short",
        (
            (f"max by (hpc_job) (aihpc_rl_reward_mean{J})", "reward {{hpc_job}}"),
            (f"max by (hpc_job) (aihpc_rl_kl{J})", "KL {{hpc_job}}"),
        ),
        "The last step's mean reward over every rank's samples and its mean KL to the reference.",
    ),
    Panel(
        RL_ROW,
        "Response length and staleness",
        "short",
        (
            (f"max by (hpc_job) (aihpc_rl_response_length_tokens{J})", "tokens {{hpc_job}}"),
            (f"max by (hpc_job) (aihpc_rl_staleness_steps{J})", "staleness {{hpc_job}}"),
            (f"max by (hpc_job) (aihpc_rl_step{J})", "GRPO step {{hpc_job}}"),
        ),
        "Mean response length of the last step; steps the rollouts lagged the policy (0: "
        "on-policy); the step the policy is at.",
    ),
)


def _panel(p: Panel) -> gd.Panel:
    builder = gs.Panel() if p.stat else gt.Panel()
    builder = builder.title(p.title).unit(p.unit).datasource(DS).span(24 if p.stat else 8)
    builder = builder.height(4 if p.stat else 8)
    if p.description:
        builder = builder.description(p.description)
    if p.stacked:
        builder = builder.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(60)
    for i, (expr, legend) in enumerate(p.targets):
        query = gp.Dataquery().expr(expr).ref_id(chr(ord("A") + i)).datasource(DS)
        builder = builder.with_target(query.legend_format(legend) if legend else query)
    return builder


def build() -> dict:
    """The dashboard as Grafana's JSON model."""
    dash = (
        gd.Dashboard("aihpc training")
        .uid("aihpc-training")
        .tags(["aihpc", "training"])
        .description("Throughput, MFU and goodput of aihpc train jobs against aihpc's plan.")
        .refresh("30s")
        .time("now-6h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            gd.QueryVariable("job")
            .label("job")
            .datasource(DS)
            .query('label_values({__name__=~"aihpc_train_info|aihpc_rl_step"}, hpc_job)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )
    row = None
    for p in PANELS:
        if p.row != row:
            dash = dash.with_row(gd.Row(p.row))
            row = p.row
        dash = dash.with_panel(_panel(p))
    return json.loads(json.dumps(dash.build(), cls=JSONEncoder))


def main() -> None:
    JSON_PATH.write_text(json.dumps(build(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {JSON_PATH}")


if __name__ == "__main__":
    main()
