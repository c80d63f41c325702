"""Megatron's --log-params-norm (perf/step/params_norm.py): the bytes each kind of parameter moves,
counted on calc_params_l2_norm's own procedure run with torch (a frozen bf16 parameter cast to
fp32 and the copy normed; a trained one's fp32 main copy normed), and where the term lands in
the step and in a VLM estimate."""

from __future__ import annotations

import dataclasses

import pytest
from frozen_vlm_spec import frozen_vlm_spec

from aihpc.perf.fit.vlm_validate import validate_vlm
from aihpc.perf.multimodal.estimate import estimate_vlm
from aihpc.perf.step import params_norm as pn
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.gemm import stream_time_s
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.runspec import runspec_from_dict

torch = pytest.importorskip("torch")


def _traffic(fn) -> int:  # type: ignore[no-untyped-def]
    """Bytes the aten ops ``fn`` runs read (tensor inputs) and write (tensor outputs), views
    left out."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    total = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func.is_view:  # no data moves (``param.data``'s detach)
                return out
            for t in tree_flatten((args, kwargs or {}, out))[0]:
                if isinstance(t, torch.Tensor):
                    total[0] += t.numel() * t.element_size()
            return out

    with Count():
        fn()
    return total[0]


def _norm_of(tensors: list) -> None:  # type: ignore[type-arg]
    # one fused norm over the list, as multi_tensor_l2norm: each tensor read once
    for t in tensors:
        torch.linalg.vector_norm(t)


@pytest.mark.parametrize("n", [1000, 4096])
def test_a_frozen_bf16_parameter_moves_the_counted_bytes(n: int) -> None:
    p = torch.randn(n).to(torch.bfloat16)
    moved = _traffic(lambda: _norm_of([p.data.float()]))
    # less the norm's one-element output (4 bytes), which the model does not count
    assert moved - 4 == pn.FROZEN_BF16_BYTES * n
    spec = runspec_from_dict(_text_spec(True))
    assert pn.norm_bytes(0, n, 1, spec.training) == pn.FROZEN_BF16_BYTES * n


@pytest.mark.parametrize("shard", [1, 4])
def test_a_trained_parameter_reads_its_main_copy_shard(shard: int) -> None:
    n = 4096
    main = torch.randn(n // shard)  # fp32, this rank's shard under the distributed optimizer
    moved = _traffic(lambda: _norm_of([main]))
    spec = runspec_from_dict(_text_spec(True))
    assert moved - 4 == pn.norm_bytes(n, 0, shard, spec.training) == pn.MAIN_COPY_BYTES * n / shard


def _text_spec(on: bool, precision: str = "bf16", zero: int = 0) -> dict:  # type: ignore[type-arg]
    return {
        "model": {"preset": "llama3-8b"},
        "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
        "parallel": {
            "tp": 1,
            "pp": 1,
            "dp": 8,
            "micro_batch_size": 1,
            "global_batch_size": 8,
            "zero_stage": zero,
        },
        "training": {"precision": precision, "log_params_norm": on},
    }


@pytest.mark.parametrize(("precision", "zero"), [("bf16", 0), ("bf16", 1), ("fp16", 1)])
def test_the_step_adds_the_norm_to_its_optimizer_term(precision: str, zero: int) -> None:
    on, off = (runspec_from_dict(_text_spec(v, precision, zero)) for v in (True, False))
    est_on = estimate_plan(on.model, on.cluster, on.plan(), on.training)
    est_off = estimate_plan(off.model, off.cluster, off.plan(), off.training)
    params = est_on.params
    assert params is not None
    # bf16: the fp32 main copy, this rank's 1/dp of it under the distributed optimizer; fp16:
    # the parameter itself, whole
    per = pn.MAIN_COPY_BYTES / (8 if zero else 1) if precision == "bf16" else 2
    # the stage's parameters as the step model holds them: within the embedding's rounding
    expected = stream_time_s(per * params.per_gpu, on.cluster.gpu, DEFAULT_PARAMS, kernels=1)
    extra = est_on.time_s["optimizer"] - est_off.time_s["optimizer"]
    assert extra == pytest.approx(expected, rel=1e-3)
    others = {k: v for k, v in est_on.time_s.items() if k != "optimizer"}
    assert others == {k: v for k, v in est_off.time_s.items() if k != "optimizer"}


def test_a_frozen_vlm_prices_every_frozen_parameter() -> None:
    """The Megatron MIMO rows (M1, M2) run --log-params-norm over a frozen Vicuna-7B and CLIP:
    the term is the frozen bytes at the memory bandwidth, off when the run does not log it."""
    rows = {r.id: r for r in validate_vlm().rows}
    for rid in ("M1", "M2"):
        est = rows[rid].estimate
        assert est.time_s["params_norm"] > 0
    spec = frozen_vlm_spec(log_params_norm=True)
    on = estimate_vlm(spec)
    off = estimate_vlm(
        dataclasses.replace(
            spec, training=dataclasses.replace(spec.training, log_params_norm=False)
        )
    )
    assert off.time_s["params_norm"] == 0.0
    assert on.step_time_s - off.step_time_s == pytest.approx(on.time_s["params_norm"])
    # more frozen bytes than the language model's alone: 10 bytes each over the rank's
    assert on.llm.params is not None
    floor = stream_time_s(
        pn.FROZEN_BF16_BYTES * on.llm.params.per_gpu, spec.cluster.gpu, DEFAULT_PARAMS
    )
    assert on.time_s["params_norm"] > floor


def test_deterministic_mode_fills_the_fp32_copy_first() -> None:
    """Under training.deterministic the frozen parameter's fp32 copy is filled with NaN by
    its allocation before the cast writes it: 4 more bytes a frozen parameter, none for a
    trained one (its main copy already exists)."""
    base = runspec_from_dict(_text_spec(True))
    det = dataclasses.replace(base.training, deterministic=True)
    n = 4096
    assert pn.norm_bytes(0, n, 1, det) - pn.norm_bytes(0, n, 1, base.training) == (
        pn.DETERMINISTIC_COPY_FILL_BYTES * n
    )
    assert pn.norm_bytes(n, 0, 1, det) == pn.norm_bytes(n, 0, 1, base.training)
