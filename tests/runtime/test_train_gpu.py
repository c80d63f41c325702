"""The trainer on CUDA (NCCL, bf16 autocast, CUDA RNG): bitwise resume after SIGKILL.
Skipped cleanly without a CUDA device."""

from __future__ import annotations

import json
import signal

import pytest
from train_cli import train

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPEC = """
[model]
preset = "tiny-llama"
[cluster]
gpu = "h100-sxm"
num_gpus = 1
gpus_per_node = 1
[parallel]
zero_stage = 3
micro_batch_size = 2
global_batch_size = 4
[training]
train_steps = 12
warmup_steps = 3
[checkpoint]
interval_steps = 4
async_save = true
"""


def _train(spec, run_dir, *extra):
    # deterministic cuBLAS workspaces, needed for bitwise-identical GPU runs
    return train(spec, run_dir, *extra, timeout=300, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})


def test_gpu_sigkill_resume_is_bitwise_identical(tmp_path):
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    ref = _train(spec, tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = _train(spec, tmp_path / "run", "--inject", "kill:step=6")
    assert killed.returncode == -signal.SIGKILL
    resumed = _train(spec, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = json.loads(ref.stdout), json.loads(resumed.stdout)
    assert b["resumed_from_step"] == 4
    assert a["state_sha256"] == b["state_sha256"]


def test_gpu_step_time_is_priced_for_the_gpu_at_hand(tmp_path):
    """A one-GPU plan of a 1.2 B-parameter model: the trainer's measured step time beside the
    model's prediction for the catalog GPU it runs on (benchmarks/predicted_vs_measured.py
    --gpu does six plans); the model claims about 10% on published runs, we allow 30% here."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import predicted_vs_measured as pvm

    from aihpc.runspec.tomlw import dumps_toml

    cluster = {"cluster": {"gpu": pvm.catalog_gpu(), "num_gpus": 1, "gpus_per_node": 1}}
    spec = tmp_path / "run.toml"
    spec.write_text(
        pvm.GPU_MODEL
        + dumps_toml(cluster)
        + "\n[parallel]\nmicro_batch_size = 2\nglobal_batch_size = 8\n"
        + pvm.TRAIN.format(steps=12)
    )
    r = _train(spec, tmp_path / "run", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    perf = json.loads((tmp_path / "run" / "summary.json").read_text())["performance"]
    assert perf["measured_steps"] == 11
    assert abs(perf["step_time_error"]) <= 0.3, perf
