"""What the trainer runs on a CPU host beyond a dense eager layer, priced as counted (issue 41,
item 4): the ring attention's ops and element-wise bytes under CP, the MoE per-expert loop's
cat / stack copies, the optimizer over the routed experts' weights, and the dispatcher's count
all-to-all. Counted on the trainer's own code with a dispatch mode, checked against the
constants perf/step/eager_host.py prices."""

from __future__ import annotations

import dataclasses

import pytest

from aihpc.perf.step import eager_host as eh
from aihpc.perf.step.compute import optimizer_time_s
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.cluster import GPUSpec

torch = pytest.importorskip("torch")

CPU = GPUSpec(1.0, 64.0, 10.0, 1.0, 2, 1.0, fp32_tflops=1.0, host_is_device=True)
SHAPE = (2, 8, 4, 64, 16)  # batch, heads, kv heads, seq, head dim


@pytest.fixture(scope="module")
def ring():
    from cpu_cost_workers import ring_counts

    from aihpc.bench.dist import launch_local

    return launch_local(2, ring_counts, SHAPE)


def test_the_ring_ops_priced_are_the_rings(ring) -> None:
    """fixed + per step x cp at cp 1 and 2; the extra over SDPA is what layer_host_s adds."""
    for cp in (1, 2):
        assert ring[cp]["fwd_ops"] == eh.RING_OPS_FIXED[0] + eh.RING_OPS_PER_STEP[0] * cp
        assert ring[cp]["bwd_ops"] == eh.RING_OPS_FIXED[1] + eh.RING_OPS_PER_STEP[1] * cp
    assert eh.ring_extra_ops(1) == (0.0, 0.0)
    training = dataclasses.replace(_spec({"cp": 2}).training, fused_kernels=False)
    plain = eh.layer_host_s(training, DEFAULT_PARAMS)
    ringed = eh.layer_host_s(training, DEFAULT_PARAMS, cp=2)
    extra = eh.ring_extra_ops(2)
    for i in (0, 1):
        assert ringed[i] - plain[i] == pytest.approx(extra[i] * DEFAULT_PARAMS.host_eager_op_s)


def test_the_ring_bytes_priced_are_the_rings(ring) -> None:
    """The element-wise bytes counted at cp 1 and 2 on another shape than the one the
    constants were counted on (batch 4, seq 128, head dim 32), within a tenth: the counts'
    small tensors (the log-sum-exp rows, the masks' position rows) are folded into the two
    per-element figures."""
    b, h, _, seq, d = SHAPE
    for cp in (1, 2):
        tokens = b * seq / cp
        fwd, bwd = eh.ring_attention_bytes(tokens, h, seq, d, cp)
        assert ring[cp]["fwd_bytes"] == pytest.approx(fwd, rel=0.1)
        assert ring[cp]["bwd_bytes"] == pytest.approx(bwd, rel=0.1)


def test_the_moe_loop_copies_priced_are_the_trainers() -> None:
    """The bytes cat and stack read and write in one MoE block's forward and backward (one
    process: no dispatch), against moe_loop_copy_bytes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from aihpc.runtime.moe import MoE, MoEConfig

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            out = func(*args, **(kwargs or {}))
            # the activations' and gradients' copies (not the dispatcher's int64 tables)
            if func.__name__.split(".")[0] in ("cat", "stack") and out.is_floating_point():
                self.bytes += 2 * out.numel() * out.element_size()  # read and written
            return out

    dim, ffn, experts, tokens = 32, 48, 4, 64
    moe = MoE(MoEConfig(dim=dim, num_experts=experts, top_k=2, expert_ffn_dim=ffn))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, dim, requires_grad=True)
    fwd, bwd = Copies(), Copies()
    with fwd:
        y = moe(x)
    with bwd:
        y.backward(torch.randn_like(y))
    model = _spec({}, moe=True, dim=dim, ffn=ffn).model
    want = eh.moe_loop_copy_bytes(model, tokens * 2, experts)
    assert fwd.bytes == want[0]
    assert bwd.bytes == want[1]


def test_the_optimizer_updates_the_routed_experts() -> None:
    """Twice the experts (the same tensors: w1, w3, w2 stacked) cost the optimizer exactly the
    added experts' bytes at the host's bandwidth (the routed experts were missing from it),
    and the router's wider gate."""
    from aihpc.perf.step.plan_batch import layer_params_split

    def optimizer(experts: int) -> tuple[float, float]:
        spec = _spec({}, moe=True, experts=experts)
        est = estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training)
        routed = layer_params_split(spec.model, spec.model.num_layers, 1, 1, 1)[1]
        return est.time_s["optimizer"], routed

    (four, routed4), (eight, routed8) = optimizer(4), optimizer(8)
    assert routed4 == 4 * 4 * 3 * 256 * 352  # layers x experts x (w1, w3, w2) x h x ffn
    spec = _spec({}, moe=True)
    gate = 4 * 4 * 256  # layers x added experts x h
    added = optimizer_time_s(routed8 - routed4 + gate, 0, 1, spec.cluster.gpu, DEFAULT_PARAMS,
                             spec.training, 0)  # fmt: skip
    assert eight - four == pytest.approx(added, rel=1e-9)
    assert added > 0


def _spec(parallel: dict, moe: bool = False, experts: int = 4, dim: int = 0, ffn: int = 352):
    model: dict = {"preset": "tiny-llama-small"}
    if moe:
        model.update(num_experts=experts, moe_top_k=2, moe_ffn_hidden_size=ffn)
    if dim:
        model.update(hidden_size=dim, num_attention_heads=4, num_kv_heads=2)
    gpu = {"bf16_tflops": 0.1, "fp32_tflops": 0.1, "hbm_gib": 16, "hbm_bw_GBps": 20.0,
           "scale_up_bw_GBps": 1.0, "scale_up_domain": 2, "scale_out_bw_GBps": 1.0,
           "gpus_per_node": 2, "host_is_device": True}  # fmt: skip
    two = parallel.get("cp") or parallel.get("ep")
    cluster = {"num_gpus": 2 if two else 1, "gpus_per_node": 2, "gpu_spec": gpu}
    return runspec_from_dict(
        {
            "model": model,
            "cluster": cluster,
            "training": {"fused_kernels": False},
            "parallel": {"global_batch_size": 8, "micro_batch_size": 4, **parallel},
        }
    )


def test_ep_pays_the_in_step_latency_of_each_of_its_five_all_to_alls() -> None:
    """Under EP on a CPU host every MoE layer and micro-batch makes five gloo all-to-alls (the
    count table, the tokens and the combine forward; the two gradients backward: the counts are
    kept), each at the calibration's all_to_all latency (calibrate --local measures it): 4
    layers, one micro-batch per rank, so a millisecond more latency is 20 ms more ep_comm."""
    from aihpc.runspec.calibration import Calibration, CommFit, CommRegime

    def ep_comm(latency_us: float) -> float:
        spec = _spec({"ep": 2, "zero_stage": 0}, moe=True)
        fit = CommFit("all_to_all", "scale_up", (CommRegime(latency_us, 1e6),), num_ranks=2)
        cal = Calibration(comm={("all_to_all", "scale_up"): fit})
        cluster = dataclasses.replace(spec.cluster, calibration=cal)
        est = estimate_plan(spec.model, cluster, spec.plan(), spec.training)
        return est.time_s["ep_comm"]

    assert ep_comm(2000.0) - ep_comm(1000.0) == pytest.approx(4 * 5 * 1e-3, rel=1e-6)
