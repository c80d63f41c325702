"""The eager ops a CPU host's inference step is priced with (perf/infer/kernels.py:
EAGER_OPS_PER_LAYER, EAGER_OPS_OUTSIDE) are the ops the trainer's Llama dispatches in one
prefill and one decode step, counted with a TorchDispatchMode (views included), per layer from
the difference of two models one layer apart."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from aihpc.perf.infer import estimate_inference  # noqa: E402
from aihpc.perf.infer.kernels import EAGER_OPS_OUTSIDE, EAGER_OPS_PER_LAYER  # noqa: E402
from aihpc.perf.step.params import DEFAULT_PARAMS  # noqa: E402
from aihpc.runspec.cluster import GPUSpec  # noqa: E402
from aihpc.runspec.model import model_from_table  # noqa: E402


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _ops(layers: int, kv_heads: int, batch: int, prompt: int) -> dict[str, int]:
    from aihpc.runtime import Llama, LlamaConfig

    cfg = LlamaConfig(
        dim=64, num_layers=layers, num_heads=4, num_kv_heads=kv_heads, ffn_dim=96,
        vocab_size=128, max_seq_len=64,
    )  # fmt: skip
    model = Llama(cfg)
    model.init_weights(0)
    model.eval()
    tokens = torch.zeros((batch, prompt), dtype=torch.long)
    out = {}
    with torch.inference_mode():
        model.prefill(tokens, capacity=prompt + 2)  # warm-up: lazy caches, first calls
        count = _Count()
        with count:
            _, cache = model.prefill(tokens, capacity=prompt + 2)
        out["prefill"] = count.n
        count = _Count()
        with count:
            model.decode_step(tokens[:, 0], cache)
        out["decode"] = count.n
    return out


@pytest.mark.parametrize(("kv_heads", "batch", "prompt"), [(2, 1, 8), (4, 3, 16)])
def test_the_priced_eager_ops_are_the_trainer_llamas(kv_heads: int, batch: int, prompt: int):
    one, two = _ops(1, kv_heads, batch, prompt), _ops(2, kv_heads, batch, prompt)
    for kind in ("prefill", "decode"):
        per_layer = two[kind] - one[kind]
        assert per_layer == EAGER_OPS_PER_LAYER[kind], kind
        assert one[kind] - per_layer == EAGER_OPS_OUTSIDE, kind


def test_a_cpu_host_prices_its_counted_ops_at_the_op_time() -> None:
    cpu = GPUSpec(
        bf16_tflops=0.1, fp32_tflops=0.1, hbm_gib=8, hbm_bw_GBps=20, scale_up_bw_GBps=5,
        scale_up_domain=1, scale_out_bw_GBps=5, gpus_per_node=1, gemm_efficiency=1.0,
        host_is_device=True,
    )  # fmt: skip
    tiny = model_from_table({"preset": "tiny-llama-small"})
    kw = {"batch": 2, "prompt_len": 64, "output_len": 16, "act_dtype": "fp32"}
    e = estimate_inference(tiny, cpu, **kw)
    ops = tiny.num_layers * EAGER_OPS_PER_LAYER["decode"] + EAGER_OPS_OUTSIDE
    assert e.decode.terms()["launches"] == pytest.approx(ops * DEFAULT_PARAMS.host_cpu_op_s)
    # a measured op time (a benchmark's calibration step) prices the same ops
    slow = DEFAULT_PARAMS.__class__(**{**vars(DEFAULT_PARAMS), "host_cpu_op_s": 5e-6})
    e5 = estimate_inference(tiny, cpu, params=slow, **kw)
    assert e5.decode.terms()["launches"] == pytest.approx(ops * 5e-6)


def test_weights_stream_at_a_matrix_vector_products_rate_where_given() -> None:
    base = dict(  # fast enough arithmetic that a batch-1 decode is bound by its reads
        bf16_tflops=10.0, fp32_tflops=10.0, hbm_gib=8, hbm_bw_GBps=20, scale_up_bw_GBps=5,
        scale_up_domain=1, scale_out_bw_GBps=5, gpus_per_node=1, gemm_efficiency=1.0,
        host_is_device=True,
    )  # fmt: skip
    tiny = model_from_table({"preset": "tiny-llama-small"})
    kw = {"batch": 1, "prompt_len": 64, "output_len": 16, "act_dtype": "fp32"}
    copy = estimate_inference(tiny, GPUSpec(**base), **kw)
    gemv = estimate_inference(tiny, GPUSpec(**base, weight_stream_GBps=8.0), **kw)
    # a batch-1 decode step reads every weight once: slower at the slower rate, by the weights
    slower = gemv.decode.terms()["gemm"] - copy.decode.terms()["gemm"]
    assert slower > 0
    weights = copy.memory.weights * (1 << 30)
    assert slower <= weights / 8e9


def test_a_cpu_core_streams_weights_and_computes_one_after_the_other() -> None:
    import dataclasses

    from aihpc.perf.infer.kernels import Engine, gemm_s
    from aihpc.perf.infer.kv import ServingPlan

    cpu = GPUSpec(
        bf16_tflops=0.1, fp32_tflops=0.1, hbm_gib=8, hbm_bw_GBps=20, scale_up_bw_GBps=5,
        scale_up_domain=1, scale_out_bw_GBps=5, gpus_per_node=1, gemm_efficiency=1.0,
        host_is_device=True, weight_stream_GBps=10.0,
    )  # fmt: skip
    tiny = model_from_table({"preset": "tiny-llama-small"})
    host = Engine(tiny, cpu, ServingPlan(weight_dtype="bf16"), DEFAULT_PARAMS, act_dtype="fp32")
    instant = dataclasses.replace(host, gpu=dataclasses.replace(cpu, weight_stream_GBps=1e9))
    streaming = 512 * 1408 * 2 / 10e9
    for m in (1, 16, 1024):
        # the weights' streaming adds to the arithmetic whether or not the arithmetic is longer
        added = gemm_s(host, m, 512, 1408) - gemm_s(instant, m, 512, 1408)
        assert added == pytest.approx(streaming, rel=1e-3)
    assert gemm_s(instant, 1024, 512, 1408) > streaming  # m = 1024: the arithmetic is longer


def test_a_measured_op_time_and_decode_attention_rate_price_a_cpu_decode_step() -> None:
    """`calibrate --local` writes a CPU host's own op time (``host_op_us``) and its one-query
    attention call's rate (``decode_attention_GBps``, K and V counted once per query head): the
    op time replaces the model's constant, and the decode attention is the K and V bytes of
    every query head at that rate (PyTorch's CPU kernel reads a GQA group's cache once per
    query head), growing with the context."""
    from aihpc.perf.infer.kernels import Engine, Work, attention_decode_s
    from aihpc.perf.infer.kv import ServingPlan

    base = dict(
        bf16_tflops=0.1, fp32_tflops=0.1, hbm_gib=8, hbm_bw_GBps=20, scale_up_bw_GBps=5,
        scale_up_domain=1, scale_out_bw_GBps=5, gpus_per_node=1, gemm_efficiency=1.0,
        host_is_device=True,
    )  # fmt: skip
    tiny = model_from_table({"preset": "tiny-llama-small"})
    kw = {"batch": 2, "prompt_len": 64, "output_len": 16, "act_dtype": "fp32"}
    measured = GPUSpec(**base, host_op_us=7.0)
    e = estimate_inference(tiny, measured, **kw)
    ops = tiny.num_layers * EAGER_OPS_PER_LAYER["decode"] + EAGER_OPS_OUTSIDE
    assert e.decode.terms()["launches"] == pytest.approx(ops * 7e-6)
    rate = 25.0
    plan = ServingPlan(weight_dtype="fp32", kv_dtype="fp32")
    host = Engine(tiny, GPUSpec(**base, decode_attention_GBps=rate), plan, DEFAULT_PARAMS)
    copy = Engine(tiny, GPUSpec(**base), plan, DEFAULT_PARAMS)
    w = Work(decode_seqs=16, decode_ctx=1024)
    per_query_head = 16 * 1024 * tiny.num_attention_heads * 2 * tiny.kv_channels * 4
    assert attention_decode_s(host, w) == pytest.approx(per_query_head / (rate * 1e9))
    # the copy-bandwidth pricing reads each KV head once: the measured kernel's reads are the
    # query heads' (twice as many bytes for tiny-llama-small's 8 query heads over 4 KV heads)
    group = tiny.num_attention_heads / tiny.kv_heads
    copy_Bps = 20e9 * DEFAULT_PARAMS.hbm_efficiency
    assert group == 2 and attention_decode_s(copy, w) * copy_Bps == pytest.approx(
        per_query_head / group
    )
    longer = Work(decode_seqs=16, decode_ctx=2048)
    assert attention_decode_s(host, longer) == pytest.approx(2 * attention_decode_s(host, w))
