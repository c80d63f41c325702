"""Which prediction `aihpc train` sets beside its measured step time (issue 34: a CPU run of an
H100 spec read "-100%"): the spec's, where its [cluster] describes the device the launch ran on;
else the spec's copy for this host that `aihpc calibrate --local --spec SPEC` writes; else none,
with one sentence saying why and the command that makes one. No torch needed: the device is
named as the trainer names it (runtime.summary.device_label)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from local_host_spec import HOST_COPY

from aihpc.cli.train import _performance_line
from aihpc.perf.step import estimate
from aihpc.perf.step.flops import model_flops_per_token
from aihpc.runspec import load_runspec
from aihpc.runtime.summary import as_trained, measured_vs_predicted, spec_for_this_machine

SPEC = """[model]
preset = "tiny-llama"
seq_length = 32
[cluster]
gpu = "h100-sxm"
num_gpus = 2
gpus_per_node = 2
[parallel]
micro_batch_size = 1
global_batch_size = 4
"""
# the host's spec as `aihpc calibrate --local --nproc N` writes it, with the plan's batch
LOCAL = HOST_COPY + "[parallel]\nmicro_batch_size = 1\nglobal_batch_size = 4\n"
STEPS = [0.9, 0.12, 0.10, 0.11]  # the first pays for allocations: left out of the median


def _spec(tmp_path: Path, local_ranks: int | None = None) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(SPEC)
    if local_ranks is not None:
        (tmp_path / "run.local.toml").write_text(LOCAL.format(n=local_ranks))
    return path


def test_a_cpu_run_of_a_gpu_spec_without_a_local_copy_has_no_prediction(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_runspec(_spec(tmp_path))
    perf = measured_vs_predicted(spec, STEPS, 2, "cpu")
    assert perf["measured_step_time_s"] == pytest.approx(0.11) and perf["measured_steps"] == 3
    assert perf["predicted_step_time_s"] is perf["predicted_mfu"] is None
    assert perf["step_time_error"] is None and perf["prediction_for"] is None
    assert perf["device"] == "cpu"
    why = perf["no_prediction"]
    assert why.startswith("no prediction for this machine (cpu, 2 rank(s))")
    assert "describes h100-sxm" in why
    assert f"aihpc calibrate --local --nproc 2 --spec {spec.path}" in why
    # MFU with no prediction: over the spec's GPU peak, how far this machine is from it
    flops = model_flops_per_token(spec.model) * 4 * 32  # a step: 4 sequences of 32 tokens
    peak = spec.cluster.gpu.peak_tflops("bf16") * 1e12
    assert perf["measured_mfu"] == pytest.approx(flops / (0.11 * 2 * peak), rel=1e-12)
    line = _performance_line(perf)
    assert line == f"step time 110.0 ms measured (median of 3); {why}"
    assert "%" not in line


def test_the_local_copy_prices_this_host(tmp_path, monkeypatch):
    """The copy's [cluster] with the run spec's own model, plan and training (the copy's
    [model] here has the preset's 128 tokens; the run trained 32)."""
    monkeypatch.chdir(tmp_path)
    spec = load_runspec(_spec(tmp_path, local_ranks=2))
    perf = measured_vs_predicted(spec, STEPS, 2, "cpu")
    local = load_runspec(tmp_path / "run.local.toml")
    priced = dataclasses.replace(spec, cluster=local.cluster)
    assert priced.model.seq_length == 32 != local.model.seq_length
    est = estimate(as_trained(priced))
    assert perf["prediction_for"] == str(tmp_path / "run.local.toml")
    assert perf["no_prediction"] is None
    assert perf["predicted_step_time_s"] == pytest.approx(est.step_time_s, rel=1e-12)
    assert perf["predicted_mfu"] == pytest.approx(est.mfu, rel=1e-12)
    assert perf["step_time_error"] == pytest.approx(est.step_time_s / 0.11 - 1, rel=1e-12)
    # MFU over this host's peak (its best GEMM rate), as the prediction's
    measured_over_predicted = perf["measured_mfu"] / perf["predicted_mfu"]
    assert measured_over_predicted == pytest.approx(est.step_time_s / 0.11, rel=1e-9)
    assert _performance_line(perf).startswith(
        f"step time 110.0 ms measured (median of 3), {est.step_time_s * 1e3:.1f} ms predicted "
        f"by aihpc estimate on {tmp_path / 'run.local.toml'} ("
    )


def test_a_local_copy_in_the_current_folder_is_found(tmp_path, monkeypatch):
    """calibrate --local writes STEM.local.toml in the folder it ran in."""
    (tmp_path / "specs").mkdir()
    spec = tmp_path / "specs" / "run.toml"
    spec.write_text(SPEC)
    (tmp_path / "run.local.toml").write_text(LOCAL.format(n=2))
    monkeypatch.chdir(tmp_path)
    priced, why = spec_for_this_machine(load_runspec(spec), "cpu", 2)
    assert why is None and priced.path == "run.local.toml" and priced.cluster.gpu.host_is_device


def test_a_local_copy_measured_for_other_ranks_is_not_used(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_runspec(_spec(tmp_path, local_ranks=4))
    priced, why = spec_for_this_machine(spec, "cpu", 2)
    assert priced is None
    assert "run.local.toml measured it as 4 rank(s)" in why and "--nproc 2" in why


@pytest.mark.parametrize(
    ("device", "matches"),
    [
        ("NVIDIA H100 80GB HBM3", True),
        ("NVIDIA H100 PCIe", True),  # the family: the catalog has one H100 part per form
        ("NVIDIA A100-SXM4-80GB", False),
        ("NVIDIA H200", False),
        ("cpu", False),
    ],
)
def test_a_gpu_spec_describes_the_devices_of_its_family(tmp_path, monkeypatch, device, matches):
    monkeypatch.chdir(tmp_path)
    spec = load_runspec(_spec(tmp_path))
    priced, why = spec_for_this_machine(spec, device, 2)
    assert (priced is spec) is matches and (why is None) is matches
    if not matches:
        assert f"no prediction for this machine ({device}, 2 rank(s))" in why


def test_a_cpu_hosts_spec_is_not_a_gpus(tmp_path, monkeypatch):
    """A spec `calibrate --local` wrote on a CPU prices that CPU, not a GPU the run found."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "host.toml").write_text(LOCAL.format(n=1))
    host = load_runspec(tmp_path / "host.toml")
    assert spec_for_this_machine(host, "cpu", 1) == (host, None)
    priced, why = spec_for_this_machine(host, "NVIDIA H100 80GB HBM3", 1)
    assert priced is None and "describes CPU x86_64 (1 threads) as 1 rank(s)" in why
