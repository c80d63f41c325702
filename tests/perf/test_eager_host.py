"""An eager dense decoder's host issue (perf/step/eager_host.py): the op counts it prices are the
trainer's own, counted with a dispatch mode on aihpc's decoder; the estimate adds exactly
counted ops x the cost per op where the host is the device, hides it behind a GPU's kernels
where they take longer, and leaves fused (compiled) specs alone."""

from __future__ import annotations

import dataclasses

import pytest

from aihpc.perf.step import dtensor_host as dh
from aihpc.perf.step import eager_host as eh
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.cluster import GPUSpec

CPU = GPUSpec(1.0, 64.0, 10.0, 1.0, 2, 1.0, fp32_tflops=1.0, host_is_device=True)


def _count(layers: int, experts: int = 0) -> dict[str, int]:
    """Aten ops of one micro-batch's forward and backward of the trainer's decoder (``experts``:
    its MoE variant, top-2) and of one optimizer step with clipping, on plain tensors (the
    second step: the first creates the optimizer's state)."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from aihpc.runspec.training import TrainingSpec
    from aihpc.runtime.config import LlamaConfig, MoEConfig
    from aihpc.runtime.job import build_optimizer
    from aihpc.runtime.model import Llama
    from aihpc.runtime.step import clip_grad_norm, token_loss

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            self.ops += 1
            return func(*args, **(kwargs or {}))

    moe = MoEConfig(dim=32, num_experts=experts, top_k=2, expert_ffn_dim=32) if experts else None
    cfg = LlamaConfig(
        dim=32, num_layers=layers, num_heads=4, num_kv_heads=2, ffn_dim=64, vocab_size=256,
        max_seq_len=8, moe=moe,
    )  # fmt: skip
    model = Llama(cfg)
    model.init_weights(0)
    opt, _ = build_optimizer(model, TrainingSpec())
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    out: dict[str, int] = {}
    for _ in range(2):
        fwd, bwd, step = Counter(), Counter(), Counter()
        with fwd:
            loss = token_loss(model(tokens), tokens)
        with bwd:
            loss.backward()
        with step:
            clip_grad_norm(list(model.parameters()), 1.0, None)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out = {"fwd": fwd.ops, "bwd": bwd.ops, "optimizer": step.ops}
    return out


@pytest.mark.parametrize("layers", [1, 2])
def test_the_priced_op_counts_are_the_trainers(layers: int) -> None:
    got = _count(layers)
    assert got["fwd"] == eh.OUTSIDE_OPS[0] + layers * eh.DENSE_LAYER_OPS[0]
    assert got["bwd"] == eh.OUTSIDE_OPS[1] + layers * eh.DENSE_LAYER_OPS[1]
    eager = dataclasses.replace(_spec().training, fused_kernels=False)
    priced = eh.optimizer_eager_host_s(layers, 1, False, CPU, eager, DEFAULT_PARAMS)
    assert priced / DEFAULT_PARAMS.host_eager_op_s == pytest.approx(got["optimizer"], abs=1e-9)


@pytest.mark.parametrize("experts", [4, 8])
def test_the_priced_moe_layer_op_counts_are_the_trainers(experts: int) -> None:
    """An MoE layer's ops (one more layer's count) are eager_host.layer_ops at its experts, not
    the dense layer's: the router, dispatcher and per-expert loop issue ~2x the dense ops."""
    one, two = _count(1, experts), _count(2, experts)
    layer = (two["fwd"] - one["fwd"], two["bwd"] - one["bwd"])
    assert layer == eh.layer_ops(experts)
    assert sum(layer) > sum(eh.DENSE_LAYER_OPS)


def test_on_a_cpu_an_moe_layer_pays_its_own_ops() -> None:
    """dp2, 4 layers, one micro-batch a rank: the MoE step pays 4 layer passes of the MoE layer's
    counted ops where the dense one pays the dense layer's (the rest of the step's ops, outside
    the layers and in the optimizer, are priced alike for both)."""
    moe = {"num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 352}
    dense, sparse = _spec(zero_stage=0, dp=2), _spec(moe, zero_stage=0, dp=2)
    op_s = 20e-6
    extra_dense = _step(dense, op_s) - _step(dense, 0.0)
    extra_moe = _step(sparse, op_s) - _step(sparse, 0.0)
    passes = dense.model.num_layers  # one micro-batch: global 8 / dp 2 / micro-batch 4
    more = passes * (sum(eh.layer_ops(4)) - sum(eh.DENSE_LAYER_OPS))
    assert extra_moe - extra_dense == pytest.approx(more * op_s, rel=1e-9)


def _spec(model: dict | None = None, **parallel) -> object:
    return runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small", **(model or {})},
            "cluster": {"gpu_spec": dataclasses.asdict(CPU), "num_gpus": 2, "gpus_per_node": 2},
            "parallel": {"micro_batch_size": 4, "global_batch_size": 8, **parallel},
        }
    )  # fmt: skip


def _step(spec, op_s: float, fused: bool = False, gpu: GPUSpec = CPU) -> float:
    params = dataclasses.replace(DEFAULT_PARAMS, host_eager_op_s=op_s)
    cluster = dataclasses.replace(spec.cluster, gpu=gpu)
    training = dataclasses.replace(spec.training, fused_kernels=fused)
    return estimate_plan(spec.model, cluster, spec.plan(), training, params).step_time_s


@pytest.mark.parametrize(
    ("parallel", "micro"),
    [({"dp": 2, "zero_stage": 0}, 1), ({"dp": 1, "pp": 2, "zero_stage": 0}, 2)],
    ids=["dp2", "pp2"],
)
def test_on_a_cpu_the_step_pays_every_counted_op(parallel: dict, micro: int) -> None:
    """dp2: one micro-batch per rank (global 8 / 2 ranks / 4); pp2: two, on the last stage's
    two layers (the slowest stage), 1F1B's bubble adding one slot of the same per-micro-batch
    time."""
    spec = _spec(**parallel)
    pp = spec.plan().pp
    layers = spec.model.num_layers // pp
    per_micro = sum(eh.OUTSIDE_OPS) + layers * sum(eh.DENSE_LAYER_OPS)
    slots = micro + (pp - 1)  # 1F1B: (pp - 1) bubble slots of one micro-batch's time
    ops = slots * per_micro
    ops += (eh.OPTIMIZER_OPS_PER_TENSOR + eh.CLIP_OPS_PER_TENSOR) * dh.stage_tensors(
        layers, pp, False
    )[0]
    ops += dh.stage_tensors(layers, pp, False)[1] + eh.OPTIMIZER_FIXED_OPS
    extra = _step(spec, 20e-6) - _step(spec, 0.0)
    assert extra == pytest.approx(ops * 20e-6, rel=1e-9)


def test_fused_kernels_pay_no_eager_issue() -> None:
    spec = _spec(dp=2, zero_stage=0)
    assert _step(spec, 20e-6, fused=True) == _step(spec, 0.0, fused=True)


def test_on_a_gpu_the_issue_hides_behind_longer_kernels() -> None:
    """A GPU's kernels run while the host issues the next ones: a pass costs its kernels or its
    host issue, the longer. Slow kernels hide a cheap issue; fast ones expose an expensive one."""
    spec = _spec(dp=2, zero_stage=0)
    slow = dataclasses.replace(CPU, host_is_device=False)  # 1 TFLOP/s: kernels take ms
    assert _step(spec, 1e-7, gpu=slow) == _step(spec, 0.0, gpu=slow)
    fast = dataclasses.replace(slow, bf16_tflops=1e4, fp32_tflops=1e4, hbm_bw_GBps=1e5)
    exposed = _step(spec, 1e-3, gpu=fast) - _step(spec, 0.0, gpu=fast)
    assert 0 < exposed < _step(spec, 1e-3) - _step(spec, 0.0)  # less than on a CPU host
