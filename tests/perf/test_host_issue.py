"""The host's issue of a layer's kernels (perf/step/host_issue.py): the eager op counts it prices
are the trainer's own layer's, counted with a dispatch mode; the estimate adds the host time a
GPU waits for beyond its kernels, for eager and compiled layers only, never on a CPU, and the
trainer's summary prices a compiled run as compiled."""

from __future__ import annotations

import dataclasses

import pytest

from aihpc.perf.step import host_issue as hi
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS as P
from aihpc.runspec import runspec_from_dict

# aten ops that launch no kernel: views and metadata
METADATA = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.t.default",
    "aten.transpose.int",
    "aten.select.int",
    "aten.slice.Tensor",
    "aten.detach.default",
    "aten.expand.default",
}


def _count_layer_ops() -> dict[str, tuple[int, int]]:
    """(kernel ops, metadata ops) of one dense decoder layer of runtime/model.py, forward and
    backward, under bf16 autocast as the trainer runs a GPU step."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from aihpc.runtime.config import LlamaConfig
    from aihpc.runtime.model import Block, rope_tables

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops, self.meta = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in METADATA:
                self.meta += 1
            else:
                self.ops += 1
            return func(*args, **(kwargs or {}))

    cfg = LlamaConfig(
        dim=64, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=176, vocab_size=256,
        max_seq_len=32,
    )  # fmt: skip
    block = Block(cfg)
    cos, sin = rope_tables(32, cfg.head_dim, 10000.0)
    x = torch.randn(2, 32, 64, requires_grad=True)
    rope = (cos, sin, torch.arange(32)[None])
    with torch.autocast("cpu", dtype=torch.bfloat16), Count() as fwd:
        y = block(x, rope)
    grad = torch.randn_like(y)
    with Count() as bwd:
        y.backward(grad)
    return {"fwd": (fwd.ops, fwd.meta), "bwd": (bwd.ops, bwd.meta)}


def test_the_priced_eager_op_counts_are_the_trainers_layer() -> None:
    got = _count_layer_ops()
    assert got["fwd"] == hi.EAGER_FWD_OPS
    assert got["bwd"] == hi.EAGER_BWD_OPS


def _spec(gpu: str, **training):
    return runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small"},
            "cluster": {"gpu": gpu, "num_gpus": 1},
            "parallel": {"micro_batch_size": 1, "global_batch_size": 4},
            "training": training,
        }
    )


def _step(spec) -> float:
    return estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training).step_time_s


def test_an_eager_small_layer_waits_on_its_host_and_compile_waits_less() -> None:
    """tiny-llama-small at micro-batch 1 on an H100: its kernels take microseconds, so the eager
    layer's ~1.6 ms of issue dominates; compiled, ~51 launches; fused kernels (Megatron, TE)
    as before."""
    fused = _step(_spec("h100-sxm"))
    eager = _step(_spec("h100-sxm", fused_kernels=False))
    compiled = _step(_spec("h100-sxm", compile=True))
    assert eager > compiled > fused
    host_fwd, host_bwd = hi.issue_host_s(_spec("h100-sxm", fused_kernels=False).training, P)
    layers, micro = 4, 4  # tiny-llama-small: 4 layers; 4 micro-batches of 1
    # most of the issue is exposed (the kernels take a few microseconds)
    assert eager - fused > 0.5 * layers * micro * (host_fwd + host_bwd)


def test_the_issue_is_hidden_behind_long_kernels_and_added_in_full_on_a_cpu() -> None:
    big = runspec_from_dict(
        {
            "model": {"preset": "llama3-8b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": {"tp": 1, "micro_batch_size": 4, "global_batch_size": 32},
        }
    )
    spec = dataclasses.replace(big, training=dataclasses.replace(big.training, compile=True))
    assert _step(spec) == _step(big)  # 4 x 8K tokens of an 8B layer: kernels outlast the issue
    from aihpc.perf.step.compute import layer_times

    cpu = dataclasses.replace(big.cluster.gpu, host_is_device=True)
    eager = dataclasses.replace(big.training, fused_kernels=False)
    from aihpc.perf.step import eager_host

    lt = layer_times(big.model, cpu, big.plan(), eager, P)
    # on a CPU the ops run on the issuing thread: their host time adds in full, counted as the
    # trainer runs them there (fp32, no autocast casts: eager_host.py), however long the kernels
    assert (lt.fwd_host, lt.bwd_host) == eager_host.layer_host_s(eager, P)
    assert lt.fwd_host > 0 and lt.bwd_host > lt.fwd_host


def test_the_trainers_summary_prices_a_compiled_run_as_compiled() -> None:
    from aihpc.runtime.summary import as_trained

    eager = as_trained(_spec("h100-sxm"))
    compiled = as_trained(_spec("h100-sxm", compile=True))
    assert not eager.training.fused_kernels and not eager.training.compile
    assert compiled.training.fused_kernels and compiled.training.compile
    assert _step(compiled) < _step(eager)


def test_compiling_the_blocks_leaves_the_rest_eager() -> None:
    """runtime/speed.py compiles each decoder block and nothing else: the embedding, final
    norm, output layer and loss are issued op by op as in an eager run, and on a CPU host the
    optimizer's per-tensor AdamW loop too (eager_host.py's counts); fused kernels without
    compile (Megatron, TE) pay neither."""
    from aihpc.perf.step import eager_host
    from aihpc.runtime.summary import as_trained

    eager = as_trained(_spec("h100-sxm")).training
    compiled = as_trained(_spec("h100-sxm", compile=True)).training
    fused = dataclasses.replace(eager, fused_kernels=True)
    assert eager_host.outside_host_s(compiled, P) == eager_host.outside_host_s(eager, P)
    assert eager_host.outside_host_s(compiled, P)[0] > 0
    assert eager_host.outside_host_s(fused, P) == (0.0, 0.0)
    cpu = dataclasses.replace(_spec("h100-sxm").cluster.gpu, host_is_device=True)
    loop = [eager_host.optimizer_eager_host_s(4, 1, False, cpu, t, P) for t in (eager, compiled)]
    assert loop[0] == loop[1] > 0
    assert eager_host.optimizer_eager_host_s(4, 1, False, cpu, fused, P) == 0.0
