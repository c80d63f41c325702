"""benchmarks/moe_expert_gemms.py --model-only: its model column is what the estimate prices the
rows' routed experts at (routed_expert_gemms without the router), read from its JSON."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aihpc.perf.fit.runs_csv import row_runspec
from aihpc.perf.fit.validate import data_file
from aihpc.perf.step.gemm import gemm_bwd_s, gemm_time_s
from aihpc.perf.step.moe_kernels import routed_expert_gemms
from aihpc.perf.step.params import DEFAULT_PARAMS

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


@pytest.mark.parametrize("script", [SCRIPT, SCRIPT.with_name("moe_layer_eager.py")])
def test_without_a_gpu_it_refuses_with_exit_2(tmp_path: Path, script: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script measures")
    r = subprocess.run(
        [sys.executable, str(script), "--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr
    assert list(tmp_path.iterdir()) == []


def _layer_fns(fp8: bool):
    """The script's timed closures on CPU tensors, tiny shapes (its GPU path, run here)."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import moe_expert_gemms
    finally:
        sys.path.remove(str(SCRIPT.parent))
    torch.manual_seed(0)
    return torch, moe_expert_gemms.layer_fns([(32, 48, 16), (32, 16, 32)], 3, fp8, "cpu")


def test_the_timed_loop_grouped_and_fp8_products_are_the_experts_products() -> None:
    torch, (fwd, bwd, grouped) = _layer_fns(fp8=False)
    loop = fwd()
    assert [tuple(t.shape) for t in loop] == [(32, 48)] * 3 + [(32, 16)] * 3
    assert [tuple(t.shape) for t in bwd()] == [(32, 16), (48, 16)] * 3 + [(32, 32), (16, 32)] * 3
    # one grouped GEMM per projection gives each expert's rows the loop's product
    assert grouped is not None
    for g, per_expert in zip(grouped(), (loop[:3], loop[3:]), strict=True):
        torch.testing.assert_close(g, torch.cat(per_expert), rtol=1e-2, atol=1e-2)
    _, (fwd8, bwd8, grouped8) = _layer_fns(fp8=True)
    assert grouped8 is None  # BF16 only
    # cuBLASLt (CUDA's _scaled_mm) takes FP8 A row-major and B column-major only; the CPU
    # kernel takes any layout, so the layouts are checked here
    scaled_mm, layouts = torch._scaled_mm, []

    def checked(a, b, **kw):
        layouts.append((a.is_contiguous(), b.t().is_contiguous()))
        return scaled_mm(a, b, **kw)

    torch._scaled_mm = checked
    try:
        products = fwd8() + bwd8()
    finally:
        torch._scaled_mm = scaled_mm
    assert len(layouts) == 18 and all(a and b for a, b in layouts), layouts
    # same seed, same operands: FP8 products within e4m3's rounding of the BF16 ones
    for a, b in zip(products, loop + bwd(), strict=True):
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert err < 0.08, err
