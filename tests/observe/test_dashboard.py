"""The Grafana dashboard: generated from code (Grafana's foundation SDK), every query reads
metrics the trainer exports, and every query returns data from the real Prometheus that scraped
the real runs."""

from __future__ import annotations

import json
import math

import pytest

from aihpc.observe.dashboards import (
    JSON_PATH,
    evaluate,
    load_dashboard,
    metrics_in,
    panel_queries,
    query_range,
    substitute,
)
from aihpc.observe.metric_names import metric_names, rl_metric_names


def test_committed_json_is_the_generated_one():
    from aihpc.observe.dashboards.build import build

    assert load_dashboard() == json.loads(json.dumps(build(), sort_keys=True)), (
        f"regenerate {JSON_PATH.name}: python -m aihpc.observe.dashboards.build"
    )


def test_dashboard_has_the_panels_the_issue_asks_for():
    titles = " | ".join(t for t, _, _ in panel_queries(load_dashboard())).lower()
    for needle in ("tokens/s", "mfu", "loss", "where the time goes", "checkpoint", "restarts"):
        assert needle in titles, needle
    assert "ettr" in titles and "aihpc goodput" in titles


def test_every_query_names_only_exported_metrics():
    exported = metric_names() | rl_metric_names()
    for title, expr, _ in panel_queries(load_dashboard()):
        names = metrics_in(expr)
        assert names, f"{title}: {expr} reads no aihpc metric"
        assert names <= exported, f"{title}: {sorted(names - exported)} not exported"


def test_template_variables_are_substituted_everywhere():
    for _, expr, _ in panel_queries(load_dashboard()):
        assert "$" not in substitute(expr, "x", "5s")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["kill_run", "hang_run"])
def test_every_query_returns_finite_data_from_prometheus(prometheus, request, which):
    from aihpc.observe.dashboards.build import DCGM_ROW, PANELS, RL_ROW

    run = request.getfixturevalue(which)
    start, end = run.begin, run.end + 2
    # the GPU row needs dcgm-exporter and a GPU's labels: test_metrics_dcgm.py evaluates it; the
    # RL row reads aihpc rl train's figures: test_rl_panels_return_finite_data evaluates it
    gpu_row = {p.title for p in PANELS if p.row in (DCGM_ROW, RL_ROW)}
    for title, expr, _ in panel_queries(load_dashboard()):
        if title in gpu_row:
            continue
        # Grafana's $__rate_interval is at least 4x the scrape interval: 4 x 0.5 s here
        result = query_range(prometheus.url, substitute(expr, run.job, "4s"), start, end, 0.5)
        finite = [float(v) for s in result for _, v in s["values"] if math.isfinite(float(v))]
        assert finite, f"{title}: {expr} gave no finite value"
    # one panel followed end to end: restarts end at 1, hangs at 1 only where rank 1 hung
    panels = evaluate(prometheus.url, load_dashboard(), start, end, 0.5, run.job, "4s")
    restarts = next(p for p in panels if p.title == "Restarts and hangs")
    # the highest value, not the last: at the tail one rank's series has gone stale before the
    # other's, and a sum over ranks then covers only the survivor
    final = {label: max(vals) for label, _, vals in restarts.series}
    assert final[f"restarts {run.job}"] == 1.0
    assert final[f"hangs {run.job}"] == (1.0 if which == "hang_run" else 0.0)


@pytest.mark.slow
def test_rl_panels_return_finite_data_from_prometheus(prometheus, rl_run):
    """The RL row against a real aihpc rl train run whose metrics.prom node-exporter served."""
    from aihpc.observe.dashboards.build import PANELS, RL_ROW

    rl_titles = {p.title for p in PANELS if p.row == RL_ROW}
    assert len(rl_titles) >= 4
    start, end = rl_run.begin, rl_run.end + 1
    seen = set()
    for title, expr, _ in panel_queries(load_dashboard()):
        if title not in rl_titles:
            continue
        result = query_range(prometheus.url, substitute(expr, rl_run.job, "4s"), start, end, 0.5)
        finite = [float(v) for s in result for _, v in s["values"] if math.isfinite(float(v))]
        assert finite, f"{title}: {expr} gave no finite value"
        seen.add(title)
    assert seen == rl_titles
    # the step panel ends at the run's last step, and every phase is predicted beside measured
    panels = evaluate(prometheus.url, load_dashboard(), start, end, 0.5, rl_run.job, "4s")
    last = {label: vals[-1] for p in panels if p.title in rl_titles for label, _, vals in p.series}
    assert last[f"GRPO step {rl_run.job}"] == 16
    for phase in ("rollout", "logprob", "update", "weight_sync"):
        assert last[f"{phase} predicted"] > 0 and f"{phase} measured" in last


def test_docs_list_every_metric():
    from pathlib import Path

    from aihpc.observe.metric_names import METRICS, RL_METRICS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    for d in METRICS + RL_METRICS:
        assert f"`{d.name}`" in doc, d.name
