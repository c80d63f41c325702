"""GPU checks (NCCL, CUDA matmul); skipped cleanly without a CUDA device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args], capture_output=True, text=True, timeout=300
    )


def test_nccl_collectives_on_all_local_gpus():
    n = torch.cuda.device_count()
    colls = "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast" + (
        ",send_recv" if n > 1 else ""
    )
    res = _cli(
        "bench",
        "comm",
        "--nproc-per-node",
        str(n),
        "-C",
        colls,
        "-b",
        "1M",
        "-e",
        "64M",
        "-f",
        "8",
        "-n",
        "5",
        "-d",
        "bfloat16",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["backend"] == "nccl" and doc["wrong_rows"] == 0
    assert all(r["wrong"] == 0 for r in doc["results"])


def test_cuda_gemm_reaches_tensor_core_rates():
    from aihpc.bench.gemm import GemmConfig, run_gemm_bench

    (r,) = run_gemm_bench(GemmConfig(((8192, 8192, 8192),), "bf16", iters=10, warmup=3))
    # any datacenter GPU since V100 does > 50 dense bf16/fp16 TFLOP/s on an 8k cube
    assert r.tflops > 50
