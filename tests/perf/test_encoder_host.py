"""An eager encoder's host time (perf/multimodal/encoder_host.py): the op counts it prices are the
trainer's own, counted with a dispatch mode on runtime/vlm/model.py's VisionLlama, the same for any
number of images; the estimate adds counted ops x the cost per op where the host is the device,
hides them behind a GPU's longer kernels, prices the blocks' ZeRO-3 gathers with the step model's
collectives, and leaves fused specs alone."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from aihpc.perf.multimodal import encoder_host as enh
from aihpc.perf.multimodal.encoder import layer_params
from aihpc.perf.multimodal.estimate import estimate_vlm
from aihpc.perf.multimodal.imbalance import Grid
from aihpc.perf.step import eager_host as eh
from aihpc.perf.step.comm import collective_time_s
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.cluster import GPUSpec

ROOT = Path(__file__).resolve().parents[2]
CPU = GPUSpec(1.0, 64.0, 10.0, 1.0, 2, 1.0, fp32_tflops=1.0, host_is_device=True)


def _example(**parallel: object) -> dict:
    raw = tomllib.loads((ROOT / "examples/vlm/tiny-vlm-train.toml").read_text())
    raw["parallel"] |= parallel
    return raw


def _cpu_spec(fused: bool = False, **parallel: object):  # type: ignore[no-untyped-def]
    raw = _example(**parallel)
    raw["cluster"] = {"gpu_spec": dataclasses.asdict(CPU), "num_gpus": 2, "gpus_per_node": 2}
    raw["training"] |= {"fused_kernels": fused, "dtensor_dispatch": "eager"}
    return runspec_from_dict(raw)


def _count(enc_layers: int, images: int, hidden: int, recompute: bool) -> dict[str, int]:
    """Aten ops of one micro-batch's forward (with text_loss) and backward of the trainer's VLM
    (a 1-layer decoder) and of one clipped AdamW step, on plain tensors (the second step)."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from aihpc.runspec.training import TrainingSpec
    from aihpc.runtime.config import LlamaConfig
    from aihpc.runtime.job import build_optimizer
    from aihpc.runtime.step import clip_grad_norm
    from aihpc.runtime.vlm.images import IMAGE_TOKEN
    from aihpc.runtime.vlm.model import VisionLlama
    from aihpc.runtime.vlm.step import text_loss

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            self.ops += 1
            return func(*args, **(kwargs or {}))

    vision = runspec_from_dict(_example()).vision
    assert vision is not None
    v = dataclasses.replace(vision, num_layers=enc_layers, projector_hidden=hidden)
    cfg = LlamaConfig(
        dim=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=64, vocab_size=256,
        max_seq_len=64,
    )  # fmt: skip
    model = VisionLlama(cfg, v, encoder_recompute=recompute)
    model.init_weights(0)
    opt, _ = build_optimizer(model, TrainingSpec())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (2, 64), generator=gen)
    per_row = [min(images, 3), images - min(images, 3)]  # 3 slots of 16 tokens a row
    for row, n in enumerate(per_row):
        tokens[row, : v.tokens_per_tile * n] = IMAGE_TOKEN
    pixels = torch.randn(2, 3, 3, v.image_size, v.image_size, generator=gen)
    out: dict[str, int] = {}
    for _ in range(2):
        fwd, bwd, step = Counter(), Counter(), Counter()
        with fwd:
            loss = text_loss(model(tokens, pixels), tokens)
        with bwd:
            loss.backward()
        with step:
            clip_grad_norm(list(model.parameters()), 1.0, None)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out = {"fwd": fwd.ops, "bwd": bwd.ops, "optimizer": step.ops}
    return out


@pytest.mark.parametrize(
    ("enc_layers", "images", "hidden", "recompute"),
    [(1, 1, 64, False), (2, 1, 64, False), (2, 6, 64, False), (2, 1, 0, False), (1, 4, 64, True),
     (2, 2, 64, True)],
)  # fmt: skip
def test_the_priced_encoder_op_counts_are_the_trainers(
    enc_layers: int, images: int, hidden: int, recompute: bool
) -> None:
    got = _count(enc_layers, images, hidden, recompute)
    raw = _example()
    raw["model"]["vision"] |= {"num_layers": enc_layers, "projector_hidden": hidden}
    raw["multimodal"]["encoder_recompute"] = "full" if recompute else "none"
    spec = runspec_from_dict(raw)
    assert spec.vision is not None and spec.multimodal is not None
    fwd, bwd = enh.encoder_ops(spec.vision, spec.multimodal)
    assert got["fwd"] - eh.OUTSIDE_OPS[0] - eh.DENSE_LAYER_OPS[0] == fwd
    assert got["bwd"] - eh.OUTSIDE_OPS[1] - eh.DENSE_LAYER_OPS[1] == bwd
    training = dataclasses.replace(spec.training, fused_kernels=False)
    decoder = eh.optimizer_eager_host_s(1, 1, False, CPU, training, DEFAULT_PARAMS)
    count, matrices = enh.encoder_tensors(spec.vision)
    per_tensor = eh.OPTIMIZER_OPS_PER_TENSOR + eh.CLIP_OPS_PER_TENSOR
    decoder_ops = decoder / DEFAULT_PARAMS.host_eager_op_s
    assert got["optimizer"] - decoder_ops == pytest.approx(per_tensor * count + matrices, abs=1e-6)


def test_on_a_cpu_every_micro_batch_pays_the_counted_ops() -> None:
    """The encoder term of the example (two micro-batches a rank) grows by exactly two
    micro-batches' counted ops at the cost per op; the imbalance, a spread, does not move."""
    eager, fused = _cpu_spec(), _cpu_spec(fused=True)
    assert eager.vision is not None and eager.multimodal is not None
    a = estimate_vlm(eager, placement="replicated")
    b = estimate_vlm(fused, placement="replicated")
    fwd, bwd = enh.encoder_ops(eager.vision, eager.multimodal)
    m = eager.plan().global_batch_size // (eager.plan().dp * eager.plan().micro_batch_size)
    host = m * (fwd + bwd) * DEFAULT_PARAMS.host_eager_op_s
    assert a.time_s["encoder"] - b.time_s["encoder"] == pytest.approx(host, rel=1e-6)
    assert a.time_s["encoder_imbalance"] == pytest.approx(b.time_s["encoder_imbalance"], rel=1e-6)
    count, matrices = enh.encoder_tensors(eager.vision)
    plain = (9 * count + matrices) * DEFAULT_PARAMS.host_eager_op_s
    dtensor = (7 * count + matrices) * enh.OPTIMIZER_DTENSOR_OP_S  # FSDP2: DTensor parameters
    assert a.time_s["encoder_optimizer"] == pytest.approx(plain + dtensor, rel=1e-9)
    assert b.time_s["encoder_optimizer"] == 0.0


def test_on_a_gpu_the_host_hides_behind_longer_kernels() -> None:
    slow = Grid.of([0.010, 0.030], [0.5, 0.5])
    assert enh.with_host(slow, 0.002, dataclasses.replace(CPU, host_is_device=False)) is slow
    fast = Grid.of([0.0, 0.004], [0.5, 0.5])
    bound = enh.with_host(fast, 0.002, dataclasses.replace(CPU, host_is_device=False))
    assert bound.mean == pytest.approx(0.5 * 0.002 + 0.5 * 0.004, rel=1e-3)
    on_cpu = enh.with_host(fast, 0.002, CPU)
    assert on_cpu.mean == pytest.approx(fast.mean + 0.002, rel=1e-9)
    assert on_cpu.quantile(0.99) - fast.quantile(0.99) == pytest.approx(0.002, rel=1e-9)


def test_zero3_gathers_each_encoder_block_twice_a_micro_batch() -> None:
    """FSDP2 (bucketed) ZeRO-3: 2 all-gathers per block and micro-batch beyond what hides behind
    the encoder, one reduce-scatter per block and step; none under ZeRO 2 or DeepSpeed's
    per-tensor gathers; under PP one of each per block."""
    spec = _cpu_spec()
    v, plan, cluster, training = spec.vision, spec.plan(), spec.cluster, spec.training
    assert v is not None and plan.zero_stage == 3
    n = layer_params(v) + 7 * v.hidden_size + v.ffn_hidden_size
    ag = collective_time_s(cluster, "all_gather", 4.0 * n, 2, 1, DEFAULT_PARAMS)
    rs = collective_time_s(cluster, "reduce_scatter", 4.0 * n, 2, 1, DEFAULT_PARAMS)
    bare = enh.fsdp_comm_s(v, cluster, plan, training, DEFAULT_PARAMS, 2, 0.0)
    assert bare.exposed == pytest.approx(2 * v.num_layers * 2 * ag + v.num_layers * rs, rel=1e-12)
    assert bare.hidden == 0.0
    assert bare.forward == pytest.approx(2 * v.num_layers * ag, rel=1e-12)  # the forwards' half
    window = ag  # a quarter of a micro-batch's gathers hide
    hid = enh.fsdp_comm_s(v, cluster, plan, training, DEFAULT_PARAMS, 2, window)
    assert hid.exposed == pytest.approx(bare.exposed - 2 * window)
    assert hid.hidden == pytest.approx(2 * ag)
    per_tensor = dataclasses.replace(training, zero3_gather="per_tensor")
    none = (0.0, 0.0, 0.0)
    assert enh.fsdp_comm_s(v, cluster, plan, per_tensor, DEFAULT_PARAMS, 2, 0.0) == none
    zero2 = dataclasses.replace(plan, zero_stage=2)
    assert enh.fsdp_comm_s(v, cluster, zero2, training, DEFAULT_PARAMS, 2, 0.0) == none
    pp2 = dataclasses.replace(plan, pp=2)  # the blocks gathered once a step, reduced once
    piped = enh.fsdp_comm_s(v, cluster, pp2, training, DEFAULT_PARAMS, 2, 0.0)
    assert piped.exposed == pytest.approx(v.num_layers * (ag + rs), rel=1e-12)
    est = estimate_vlm(spec, placement="replicated")
    host_mb = sum(enh.encoder_ops(v, spec.multimodal)) * DEFAULT_PARAMS.host_eager_op_s
    kernels_mb = est.time_s["encoder"] / 2 - host_mb  # two micro-batches a rank
    window = DEFAULT_PARAMS.overlap_efficiency * kernels_mb
    assert est.time_s["encoder_dp_comm"] == pytest.approx(
        enh.fsdp_comm_s(v, cluster, plan, training, DEFAULT_PARAMS, 2, window).exposed, rel=1e-6
    )
