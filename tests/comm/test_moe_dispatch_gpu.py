"""Our dispatch / combine on GPUs over NCCL; skipped cleanly without a CUDA device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from gpu_workers import nccl_vs_cpu  # noqa: E402

from aihpc.bench.dist import launch_local  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_nccl_path_is_bitwise_the_cpu_path_and_deterministic():
    res = launch_local(1, nccl_vs_cpu)
    assert res["rows_equal_cpu"] and res["combine_equal_cpu"] and res["deterministic"]


def test_nccl_on_every_local_gpu_is_deterministic():
    res = launch_local(torch.cuda.device_count(), nccl_vs_cpu)
    assert res["deterministic"]


def test_bench_moe_on_every_local_gpu():
    n = torch.cuda.device_count()
    args = ["bench", "moe", "--nproc-per-node", str(n), "--tokens", "1024", "--hidden", "2048"]
    res = subprocess.run(
        [sys.executable, "-m", "aihpc", *args, "-n", "5", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["backend"] == "nccl" and doc["wrong_rows"] == 0
    assert all(r["dispatch"]["GBps"] > 0 for r in doc["results"])
