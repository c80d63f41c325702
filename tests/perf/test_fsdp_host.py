"""Eager FSDP2 as the trainer runs ZeRO 1-3 (perf/step/fsdp_host.py): a unit per layer and the
root, each with its own gather and reduce-scatter, and the copies around them. Counted on the
trainer's own step on two gloo ranks with a dispatch mode (no mocks) and checked against what
the model prices."""

from __future__ import annotations

import dataclasses

import pytest
from cpu_host_spec import cpu_host_spec

from aihpc.perf.step import fsdp_host as fh
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS

torch = pytest.importorskip("torch")

MICRO_BATCHES = 2  # per rank: gathers repeat per micro-batch, the reduction does not


@pytest.fixture(scope="module")
def counted() -> dict:
    from cpu_cost_workers import fsdp_counts

    from aihpc.bench.dist import launch_local

    return launch_local(2, fsdp_counts, (1, 3), MICRO_BATCHES)


@pytest.mark.parametrize("zero", [1, 3])
def test_the_collectives_per_unit_are_the_trainers(counted: dict, zero: int) -> None:
    """A gather per unit and micro-batch (two under ZeRO 3), one reduce-scatter per unit."""
    c = counted[zero]
    units, gathers, reduces = fh.collectives(c["layers"], MICRO_BATCHES, zero)
    assert units == c["layers"] + 1
    assert c["ops"]["_allgather_base_"] == units * gathers
    assert c["ops"]["_reduce_scatter_base_"] == units * reduces
    copies = sum(c["ops"].get(name, 0) for name in fh.COPY_OPS)
    assert copies == units * (fh.COPIES_PER_GATHER * gathers + fh.COPIES_PER_REDUCE * reduces)


@pytest.mark.parametrize("zero", [1, 3])
def test_the_copy_bytes_priced_are_the_trainers(counted: dict, zero: int) -> None:
    """The bytes FSDP2's copies read and write, exactly (no padding: every tensor of
    tiny-llama-small splits evenly over two ranks)."""
    c = counted[zero]
    _, gathers, reduces = fh.collectives(c["layers"], MICRO_BATCHES, zero)
    full = c["param_bytes"]  # fp32 parameters and gradients on a CPU
    assert c["bytes"] == fh.copy_bytes(full, full, 2, gathers, reduces)


def _spec(zero: int, bw: float, dispatch: str = "eager"):
    return cpu_host_spec(bw, dispatch, zero_stage=zero)


def _dp_comm(zero: int, bw: float, dispatch: str = "eager") -> float:
    spec = _spec(zero, bw, dispatch)
    return estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training).time_s["dp_comm"]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_step_pays_the_counted_bytes_at_the_memory_bandwidth(counted: dict, zero: int) -> None:
    """Halving the memory bandwidth adds the counted bytes once more to the data-parallel term
    (the collectives do not read it), at the model's efficiency. The model's parameter count is
    the trainer's but for the final norm's weight (hidden size 256, fp32), which it leaves out."""
    c = counted[3 if zero == 3 else 1]  # ZeRO 2 runs as ZeRO 1 (reshard_after_forward off)
    _, gathers, reduces = fh.collectives(c["layers"], MICRO_BATCHES, zero)
    full = c["param_bytes"] - 256 * 4
    want = fh.copy_bytes(full, full, 2, gathers, reduces)
    eff = DEFAULT_PARAMS.hbm_efficiency
    fast, slow = _dp_comm(zero, 20.0), _dp_comm(zero, 10.0)
    assert slow - fast == pytest.approx(want / (eff * 10e9) - want / (eff * 20e9), rel=1e-6)


def test_megatron_style_zero_12_has_no_fsdp_copies() -> None:
    """Without eager FSDP2 (``dtensor_dispatch`` none: Megatron-Core's distributed optimizer,
    buffers gathered in place) the bandwidth does not enter ZeRO 1's data-parallel term, and
    its two bucketed collectives cost less than the trainer's per-unit ones."""
    assert _dp_comm(1, 20.0, "none") == _dp_comm(1, 10.0, "none")
    assert _dp_comm(1, 20.0, "none") < _dp_comm(1, 20.0)
    training = dataclasses.replace(_spec(1, 10.0).training, dtensor_dispatch="none")
    assert not fh.eager_fsdp(training)


@pytest.mark.parametrize(("zero", "pp"), [(1, 1), (1, 2), (3, 1)])
@pytest.mark.parametrize("m", [1, 3])
def test_the_terms_issue_the_counted_collectives(zero: int, pp: int, m: int) -> None:
    """dp_comm's eager-FSDP2 terms make the collectives ``collectives`` says (counted above):
    with nothing to hide them (no window) and each gather costing 1 and each reduce-scatter 10,
    the exposed time is their count. Copies left out here (``dtensor_dispatch`` none makes
    them 0; the bytes are checked above)."""
    from types import SimpleNamespace

    from aihpc.perf.step import dp_comm

    layers, training = 4, _spec(zero, 10.0, "none").training
    rows = SimpleNamespace(
        grad_bytes=1e6, edge_frac=0.1, layers=layers, m=m, body_param_bytes=9e5,
        edge_param_bytes=1e5, first_fwd=0.0, last_bwd=0.0, training=training, pp=pp,
    )  # fmt: skip

    def cost(kind: str, size: float) -> float:
        return {"all_gather": 1.0, "reduce_scatter": 10.0}[kind]

    term = dp_comm._fsdp_zero3 if zero == 3 else dp_comm._fsdp_zero12
    exposed, hidden = term(rows, cost, 0.0)
    units, gathers, reduces = fh.collectives(layers, m, zero, pp)
    assert gathers == (1 if pp > 1 else m) * (2 if zero == 3 else 1)
    assert exposed == units * gathers * 1.0 + units * reduces * 10.0
    assert hidden == 0.0
