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
