"""Goodput (ETTR) against GPU count for several checkpoint strategies, and its plot."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from aihpc._io import atomic_target, check_output_path
from aihpc.goodput.ettr import ettr, goodput_model, optimal_interval_s
from aihpc.runspec.runspec import RunSpec

__all__ = [
    "DEFAULT_VARIANTS",
    "FAST_RESTART",
    "goodput_curves",
    "goodput_figure",
    "plot_goodput",
    "with_scale",
]

# A faster restart: hot spare nodes and in-process restart skip rescheduling and relaunch
# (NVRx in-process restart; DeadPool reports < 40 s hot swaps, arXiv 2607.01646).
FAST_RESTART = {"detection_time_s": 10.0, "restart_time_s": 60.0}
DEFAULT_VARIANTS: dict[str, dict[str, object]] = {
    "sync": {"checkpoint_strategy": "sync"},
    "async": {"checkpoint_strategy": "async"},
    "in_memory": {"checkpoint_strategy": "in_memory"},
    "async + fast restart": {"checkpoint_strategy": "async", **FAST_RESTART},
    "in_memory + fast restart": {"checkpoint_strategy": "in_memory", **FAST_RESTART},
}


def with_scale(spec: RunSpec, num_gpus: int, **reliability: object) -> RunSpec:
    """``spec`` on ``num_gpus`` GPUs (same node size), with [reliability] fields replaced."""
    cluster = replace(spec.cluster, num_gpus=num_gpus)
    return replace(spec, cluster=cluster, reliability=replace(spec.reliability, **reliability))


def default_gpu_counts(spec: RunSpec) -> list[int]:
    """1K to 128K GPUs in powers of two of whole nodes."""
    gpn = spec.cluster.gpus_per_node
    return [gpn * (1 << k) for k in range(20) if 1024 <= gpn * (1 << k) <= 131072]


def goodput_curves(
    spec: RunSpec,
    gpu_counts: list[int],
    variants: dict[str, dict[str, object]] | None = None,
    checkpoint_bytes: float | None = None,
) -> dict[str, list[float]]:
    """ETTR at the optimal checkpoint interval for each variant and GPU count."""
    variants = DEFAULT_VARIANTS if variants is None else variants
    if checkpoint_bytes is None:
        checkpoint_bytes = goodput_model(spec).checkpoint.checkpoint_bytes
    out: dict[str, list[float]] = {}
    for label, fields in variants.items():
        row = []
        for n in gpu_counts:
            p = goodput_model(with_scale(spec, n, **fields), checkpoint_bytes).params
            row.append(ettr(p, optimal_interval_s(p)))
        out[label] = row
    return out


def _check_plot_path(path: Path) -> None:
    check_output_path(path, "--plot", ".png")  # its folder must exist and be writable


def plot_goodput(spec: RunSpec, path: str | Path, gpu_counts: list[int] | None = None) -> Path:
    """Draw ETTR against GPU count for sync / async / in-memory checkpoints and faster restarts.

    Written to a temporary file in the same directory and renamed, so a failed write never
    leaves a half-written plot.
    """
    path = Path(path)
    _check_plot_path(path)
    counts = gpu_counts or default_gpu_counts(spec)
    curves = goodput_curves(spec, counts)
    fig = goodput_figure(spec, counts, curves)
    try:
        with atomic_target(path, "--plot") as tmp:
            fig.savefig(tmp, format="png", dpi=120)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path


# One marker and line style per curve: at small scale several strategies give the same ETTR and
# their lines lie on top of each other; the markers keep each one visible.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def goodput_figure(spec: RunSpec, counts: list[int], curves: dict[str, list[float]]):  # type: ignore[no-untyped-def]
    """The figure ``plot_goodput`` writes: one line per checkpoint strategy, the job's own GPU
    count marked and named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (label, values) in enumerate(curves.items()):
        style = "--" if "fast restart" in label else "-"
        ax.plot(
            counts,
            [100 * v for v in values],
            style,
            marker=_MARKERS[i % len(_MARKERS)],
            ms=4 + (len(curves) - i) * 0.8,  # earlier curves' markers larger: they stay visible
            mfc="none",
            lw=1.4,
            label=label,
        )
    n = spec.cluster.num_gpus
    ax.axvline(n, color="grey", lw=0.9, ls=":", label=f"this run spec: {n:,} GPUs")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [f"{c / 1024:g}K" if c >= 1024 else str(c) for c in counts])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput: effective training time ratio (%)")
    ax.set_title(f"{spec.model.name} on {spec.cluster.gpu.id}: ETTR at the optimal interval")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
