"""benchmarks/moe_expert_gemms.py --model-only: its model column is what the estimate prices the
rows' routed experts at (routed_expert_gemms without the router), read from its JSON."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aihpc.perf.compute import gemm_bwd_s, gemm_time_s, routed_expert_gemms
from aihpc.perf.params import DEFAULT_PARAMS
from aihpc.perf.runs_csv import row_runspec
from aihpc.perf.validate import data_file

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_expert_gemms.py"


def test_model_only_prices_the_rows_experts_as_the_estimate_does(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-only", "--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "moe_expert_gemms.json").read_text())["rows"]
    assert [x["id"] for x in rows] == ["H08", "H09", "H12", "H13"]
    with open(data_file("moe_runs.csv"), newline="") as f:
        by_id = {x["id"]: x for x in csv.DictReader(f)}
    for row in rows:
        spec = row_runspec(by_id[row["id"]])
        m, plan, gpu = spec.model, spec.plan(), spec.cluster.gpu
        assert row["local_experts"] == m.num_experts // plan.ep
        fwd, bwd, _ = routed_expert_gemms(m, gpu, plan, spec.training, DEFAULT_PARAMS, None)
        tokens = plan.micro_batch_size * m.seq_length / (plan.cp * plan.tp)

        def router(a: float, b: float, c: float, gpu: object = gpu) -> float:
            return gemm_time_s(a, b, c, gpu, "bf16", DEFAULT_PARAMS)

        shape = (tokens, m.num_experts, m.hidden_size)
        assert row["model_fwd_ms"] == pytest.approx((fwd - router(*shape)) * 1e3, rel=1e-9)
        assert row["model_bwd_ms"] == pytest.approx(
            (bwd - gemm_bwd_s(router, *shape)) * 1e3, rel=1e-9
        )


def test_without_a_gpu_it_refuses_with_exit_2(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script measures")
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr
    assert list(tmp_path.iterdir()) == []
