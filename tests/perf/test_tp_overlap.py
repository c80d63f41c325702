"""Tensor-parallel communication overlap (perf/step/tp_overlap.py, training.tp_comm_overlap): the
chunked-overlap arithmetic behaves as a schedule must (more GEMM time never exposes more, more
communication never exposes less, the last reduce-scatter chunk always waits), the modes order
as the frameworks' mechanisms do (none >= backward >= userbuffers exposed), and the run fact
goes through the run spec, the estimate and a refused value as one line."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.perf.step import compute, tp_overlap
from aihpc.perf.step.comm import collective_time_s
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.perf.step.tp_overlap import (
    TPGemms,
    bulk_exposed_s,
    layer_tp_comm_s,
    op_recomputed_gemms,
    op_regather_s,
    pipeline_exposed_s,
    ring_exposed_s,
    tp_gemms,
)
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import model_from_table
from aihpc.runspec.training import TP_COMM_OVERLAPS, TrainingSpec

COMMS = [0.0, 1e-4, 5e-4, 1e-3, 4e-3]
GEMMS = [0.0, 1e-4, 3e-4, 1e-3, 5e-3, 2e-2]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_chunked_overlap_is_monotonic(n: int) -> None:
    """Exposed time never grows with the GEMM beside it, never shrinks with the collective,
    and never exceeds the collective run alone."""
    for f in (
        lambda c, g: ring_exposed_s(c, g, n, 0.85),
        lambda c, g: pipeline_exposed_s(c, g, n, 0.85),
        lambda c, g: bulk_exposed_s(c, g, 0.85),
    ):
        for c in COMMS:
            by_gemm = [f(c, g) for g in GEMMS]
            assert all(a >= b for a, b in itertools.pairwise(by_gemm))
            assert all(0.0 <= x <= c + 1e-18 for x in by_gemm)
        for g in GEMMS:
            by_comm = [f(c, g) for c in COMMS]
            assert all(a <= b for a, b in itertools.pairwise(by_comm))


def test_what_cannot_hide_stays_exposed() -> None:
    """A ring hides everything once each GEMM chunk outlasts its transfer; a pipeline always
    waits for its last chunk's reduce-scatter; a GEMM shorter than the collective leaves the
    difference."""
    c, n, hide = 1e-3, 8, 1.0
    assert ring_exposed_s(c, c * n / (n - 1), n, hide) == pytest.approx(0.0, abs=1e-18)
    assert pipeline_exposed_s(c, 100 * c, 4, hide) == pytest.approx(c / 4)
    assert bulk_exposed_s(c, 0.4 * c, hide) == pytest.approx(0.6 * c)
    # the overlap efficiency caps the window as for DP and CP collectives
    assert bulk_exposed_s(c, c, 0.85) == pytest.approx(0.15 * c)


def _layer(mode: str, sp: bool, comm: float, gemm: float) -> tuple[float, ...]:
    g = TPGemms(gemm, gemm, 4 * gemm, 2 * gemm)
    return layer_tp_comm_s(mode, sp, 8, comm, comm, (g, g, g), 0.85)


@pytest.mark.parametrize("sp", [True, False])
def test_modes_order_none_backward_userbuffers(sp: bool) -> None:
    """none >= backward >= userbuffers exposed, forward and backward, and exposed + hidden is
    the layer's communication whatever the mode (no chunking cost in these GEMMs)."""
    for comm in COMMS[1:]:
        for gemm in GEMMS:
            out = {m: _layer(m, sp, comm, gemm) for m in TP_COMM_OVERLAPS}
            total = 4 * comm if sp else 2 * comm
            for fwd_x, fwd_h, bwd_x, bwd_h in out.values():
                assert fwd_x + fwd_h == pytest.approx(total)
                assert bwd_x + bwd_h == pytest.approx(total)
            for i in (0, 2):
                assert out["none"][i] >= out["backward"][i] >= out["userbuffers"][i] - 1e-18
            # the default hides only in the backward; with long GEMMs userbuffers hides most
            assert out["backward"][0] == out["none"][0]
    if sp:
        fwd_x, _, bwd_x, _ = _layer("userbuffers", True, 1e-3, 2e-2)
        assert fwd_x + bwd_x < 0.1 * 8e-3


def test_without_sequence_parallelism_the_chunked_modes_run_as_backward() -> None:
    for mode in ("userbuffers", "async_tp"):
        assert _layer(mode, False, 1e-3, 5e-4) == _layer("backward", False, 1e-3, 5e-4)


def _tp8(
    mode: str,
    precision: str = "bf16",
    preset: str = "llama3-70b",
    recompute: str = "full",
    sp: bool = True,
    zero_stage: int = 1,
    mbs: int = 1,
    gbs: int = 64,
):
    """A TP 8 plan on 64 H100s; by default Llama 3 70B with full recompute."""
    return runspec_from_dict(
        {
            "model": {"preset": preset},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 64},
            "parallel": {
                "tp": 8,
                "pp": 1,
                "sequence_parallel": sp,
                "zero_stage": zero_stage,
                "recompute": recompute,
                "micro_batch_size": mbs,
                "global_batch_size": gbs,
            },
            "training": {"tp_comm_overlap": mode, "precision": precision},
        }
    )


def _llama70b(mode: str, precision: str = "bf16"):
    return _tp8(mode, precision)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_estimate_orders_the_modes(precision: str) -> None:
    """On a real plan the TP term orders as the mechanisms do, and what is hidden is charged
    as compute slow-down; FP8 halves the GEMMs the collectives hide behind, so the same
    overlap hides a smaller share of the same bytes."""
    tp, compute = {}, {}
    for mode in TP_COMM_OVERLAPS:
        spec = _llama70b(mode, precision)
        est = estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training)
        tp[mode], compute[mode] = est.time_s["tp_comm"], est.time_s["compute"]
    assert tp["none"] > tp["backward"] > tp["userbuffers"] > 0
    assert tp["none"] > tp["async_tp"] > 0
    assert compute["none"] < compute["backward"] < compute["userbuffers"]
    shares = {}
    for p in ("bf16", "fp8"):
        spec = _llama70b("async_tp", p)
        on = estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training).time_s
        spec = _llama70b("none", p)
        off = estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training).time_s
        shares[p] = on["tp_comm"] / off["tp_comm"]
    assert shares["fp8"] > shares["bf16"]


def test_chunked_gemms_cost_their_launches_and_size() -> None:
    """A GEMM run as n row chunks costs at least the whole GEMM (each chunk at its own size's
    efficiency, with its own launch); MLA and MoE layers have their own linears."""
    spec = _llama70b("userbuffers")

    def gemm(m: float, n: float, k: float) -> float:
        return compute.gemm_time_s(m, n, k, spec.cluster.gpu, "bf16", DEFAULT_PARAMS)

    plan = spec.plan()
    whole, split = tp_gemms(spec.model, plan, gemm, 0.0), tp_gemms(spec.model, plan, gemm, 0.0, 8)
    for name in ("qkv", "proj", "fc1", "fc2"):
        assert getattr(split, name) > getattr(whole, name) > 0
    mla = model_from_table({"preset": "deepseek-v3"})
    g = tp_gemms(mla, replace(plan, tp=2), gemm, mla.num_moe_layers / mla.num_layers)
    assert g.qkv > 0 and g.proj > 0 and g.fc1 > 0  # dense layers and shared experts


def _llama8b_tp8(mode: str, recompute: str, sp: bool = True):
    """torchtitan's asyncTP benchmark plan for Llama 3 8B (held-out T5-T8): FSDP 8 x TP 8."""
    return _tp8(mode, "bf16", "llama3-8b", recompute, sp, zero_stage=3, mbs=2, gbs=16)


def test_op_checkpointing_gathers_the_inputs_again_in_the_backward() -> None:
    """torchtitan's per-op SAC saves reduce-scatter outputs, not all-gather outputs: without an
    overlap the backward repeats both sequence-parallel gathers whole, so the TP term of an
    "op" plan is a "selective" plan's plus two gathers a layer; without sequence parallelism
    there is no gather to repeat."""
    spec = _llama8b_tp8("none", "op")
    plan, m = spec.plan(), spec.model
    est = estimate_plan(m, spec.cluster, plan, spec.training).time_s
    sel = _llama8b_tp8("none", "selective")
    base = estimate_plan(sel.model, sel.cluster, sel.plan(), sel.training).time_s
    act = plan.micro_batch_size * m.seq_length * m.hidden_size * 2.0
    gather = collective_time_s(spec.cluster, "all_gather", act, 8, 1, DEFAULT_PARAMS)
    steps = spec.parallel.global_batch_size // (plan.dp * plan.micro_batch_size)
    extra = steps * m.num_layers * 2 * gather
    assert est["tp_comm"] == pytest.approx(base["tp_comm"] + extra, rel=1e-9)
    no_sp = [_llama8b_tp8("none", r, sp=False) for r in ("op", "selective")]
    op, sel_ = (estimate_plan(s.model, s.cluster, s.plan(), s.training) for s in no_sp)
    assert op.time_s["tp_comm"] == pytest.approx(sel_.time_s["tp_comm"], rel=1e-12)


def test_async_tp_hides_a_repeated_gather_only_behind_a_recomputed_column_gemm() -> None:
    """Under async TP a repeated gather is micro-pipelined with the recomputed column GEMM that
    reads it (Llama: wk after the attention gather, w3 after the MLP gather); one no
    recomputed GEMM reads is exposed whole; the other modes expose both."""
    gather, hide = 1e-3, DEFAULT_PARAMS.overlap_efficiency
    assert op_regather_s("none", gather, ((5e-3, 6e-3),) * 2, 8, hide) == (2e-3, 0.0)
    assert op_regather_s("backward", gather, (), 8, hide) == (2e-3, 0.0)
    assert op_regather_s("async_tp", gather, ((0.0, 0.0),) * 2, 8, hide) == (2e-3, 0.0)
    exposed, hidden = op_regather_s("async_tp", gather, ((5e-3, 6e-3),) * 2, 8, hide)
    assert hidden > 0.0 and exposed + hidden > 2e-3  # the chunked GEMMs' cost is charged
    assert exposed == pytest.approx(2 * (6e-3 - 5e-3) + (2e-3 - hidden), rel=1e-12)
    spec = _llama8b_tp8("async_tp", "op")

    def gemm(m_: float, n: float, k: float) -> float:
        return compute.gemm_time_s(m_, n, k, spec.cluster.gpu, "bf16", DEFAULT_PARAMS)

    (attn, attn_split), (mlp, mlp_split) = op_recomputed_gemms(spec.model, spec.plan(), gemm, 0.0)
    rows, h = 2 * spec.model.seq_length, spec.model.hidden_size
    kv = spec.model.kv_heads * spec.model.kv_channels
    assert attn == pytest.approx(gemm(rows, kv / 8, h), rel=1e-12)  # wk
    assert mlp == pytest.approx(gemm(rows, spec.model.ffn_hidden_size / 8, h), rel=1e-12)  # w3
    assert attn_split > attn and mlp_split > mlp


def test_a_bad_value_is_one_line_naming_field_value_and_choices(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        TrainingSpec(tp_comm_overlap="ub")
    assert str(err.value).startswith("training.tp_comm_overlap = 'ub'")
    spec = tmp_path / "run.toml"
    spec.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 8\n'
        '[training]\ntp_comm_overlap = "overlap"\n'
    )
    res = CliRunner().invoke(app, ["estimate", str(spec)])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.output
    line = lines[0]
    assert "training.tp_comm_overlap" in line and "overlap" in line
    assert all(choice in line for choice in tp_overlap.TP_COMM_OVERLAPS)
