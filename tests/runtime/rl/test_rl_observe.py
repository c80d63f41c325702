"""What a GRPO run shows beside its metrics (runtime/rl/observe.py): each phase's last seconds
and aihpc rl estimate's prediction of them in metrics.prom, and in summary.json the measured
phases beside the predicted ones, priced on the machine the run ran on exactly as `aihpc
train` chooses it (the spec, else its `calibrate --local` copy, else none and why). No torch:
the metrics lines are the trainer's keys, the task only its lengths."""

from __future__ import annotations

import runpy
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aihpc.observe.metric_names import RL_METRICS
from aihpc.runspec import load_runspec
from aihpc.runtime.rl.metrics import RLMetrics
from aihpc.runtime.rl.observe import OBSERVED_PHASES, RLObserver, predict_phases, runtime_phases

HOST_COPY = runpy.run_path(str(Path(__file__).parents[1] / "local_host_spec.py"))["HOST_COPY"]
SPEC = """[model]
preset = "tiny-llama"
[cluster]
gpu = "h100-sxm"
num_gpus = 1
[parallel]
global_batch_size = 64
[rl]
prompts_per_step = 16
samples_per_prompt = 8
prompt_len = 6
response_len = 3
max_response_len = 3
response_dist = "fixed"
"""


@dataclass
class Task:  # the lengths RLObserver reads from runtime/rl/task.py's AdditionTask
    prompt_len: int = 6
    max_answer_len: int = 3


def _line(step: int, scale: float) -> dict:
    phases = {f"{p}_s": scale * (i + 1) / 10 for i, p in enumerate(OBSERVED_PHASES)}
    return {"step": step, "reward": 0.5, "response_len": 3.0, "kl": 0.01, "rollout_tokens": 384,
            **phases}  # fmt: skip


def _spec(tmp_path: Path, local: bool) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(SPEC)
    if local:
        (tmp_path / "run.local.toml").write_text(HOST_COPY.format(n=1))
    return path


def _gauges(prom: str, name: str) -> dict[str, float]:
    for family in text_string_to_metric_families(prom):
        if family.name == name:
            return {s.labels["phase"]: s.value for s in family.samples}
    return {}


def test_the_planners_phases_fold_into_the_measured_ones() -> None:
    planned = {"rollout": 1.0, "old_logprob": 2.0, "ref_logprob": 3.0, "critic_values": 0.5,
               "reward": 0.25, "update": 4.0, "critic_update": 1.0, "weight_sync": 0.1,
               "switch": 0.2, "orchestration": 7.0}  # fmt: skip
    got = runtime_phases(planned)
    assert set(got) == set(OBSERVED_PHASES)
    assert got["logprob"] == pytest.approx(5.5) and got["update"] == pytest.approx(5.0)
    assert got["weight_sync"] == pytest.approx(0.3)
    # what the runtime does not have (an RL framework's orchestration) is not predicted
    assert sum(got.values()) == pytest.approx(sum(planned.values()) - 7.0)


def test_prediction_on_this_hosts_copy_is_the_in_process_rl_estimate(tmp_path: Path) -> None:
    spec = load_runspec(_spec(tmp_path, local=True))
    got, why, priced = predict_phases(spec, 1, "cpu", 6, 3.0, 3)
    assert why is None and priced.endswith("run.local.toml")
    assert all(got[p] > 0 for p in ("rollout", "logprob", "update", "weight_sync"))
    # priced as this runtime runs it: the task's lengths, each rank's share in one pass
    longer, _, _ = predict_phases(spec, 1, "cpu", 6, 30.0, 30)
    assert longer["rollout"] > got["rollout"] and longer["update"] > got["update"]


def test_no_copy_for_this_machine_says_why_and_how(tmp_path: Path) -> None:
    spec = load_runspec(_spec(tmp_path, local=False))
    got, why, priced = predict_phases(spec, 1, "cpu", 6, 3.0, 3)
    assert got is None and priced is None
    assert "h100-sxm" in why and "aihpc calibrate --local" in why


@pytest.mark.parametrize("local", [True, False])
def test_metrics_prom_and_summary_hold_measured_and_predicted(tmp_path: Path, local: bool) -> None:
    spec = load_runspec(_spec(tmp_path, local))
    run = tmp_path / "run"
    run.mkdir()
    obs = RLObserver(RLMetrics(run), spec, 1, "cpu", Task())
    for step, scale in enumerate((5.0, 1.0, 1.2, 0.8), start=1):  # the first step pays setup
        obs.record(_line(step, scale))
    prom = (run / "metrics.prom").read_text()
    last = _gauges(prom, "aihpc_rl_phase_last_seconds")
    assert last == pytest.approx({p: 0.8 * (i + 1) / 10 for i, p in enumerate(OBSERVED_PHASES)})
    predicted = _gauges(prom, "aihpc_rl_predicted_phase_seconds")
    summary = obs.summary()
    for i, p in enumerate(OBSERVED_PHASES):
        row = summary["phases"][p]
        assert row["measured_s"] == pytest.approx((i + 1) / 10)  # median of steps 2-4
        if local:
            assert row["predicted_s"] == pytest.approx(predicted[p])
            assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
        else:
            assert row["predicted_s"] is None and row["error"] is None
    assert (summary["no_prediction"] is None) == local
    assert bool(predicted) == local
    # the file holds the figures observe.metric_names lists for the dashboard and the docs
    families = {f.name for f in text_string_to_metric_families(prom)} - {
        "aihpc_rl_phase_seconds_created"
    }
    listed = {d.name for d in RL_METRICS}
    assert families == listed  # without a prediction its family is declared, with no series
