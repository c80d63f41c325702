"""The page faults of an eager step's fresh allocations on a CPU host (perf/step/page_faults.py):
the large fresh tensors the model counts are the pages the trainer faults in. Counted, not
timed: processes started with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_, which also
stops glibc from raising it), so every allocation at or above it is mapped afresh and each of
its pages is one minor fault (``getrusage``'s ``ru_minflt``)."""

from __future__ import annotations

import dataclasses

import pytest

from aihpc.perf.step import page_faults as pf
from aihpc.perf.step.estimate import estimate_plan
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import model_from_table

torch = pytest.importorskip("torch")

# (layers, batch, dim, heads, kv heads, ffn): tiny-llama-small's layer at 1 and 2 layers, a
# wider one with fewer KV heads, and twice the tokens
SHAPES = [
    (1, 4, 256, 8, 4, 704),
    (2, 4, 256, 8, 4, 704),
    (1, 4, 384, 6, 2, 1024),
    (2, 4, 384, 6, 2, 1024),
    (2, 8, 256, 8, 4, 704),
]
# what a pass faults beyond its large tensors (the loss's and the norms' small ones, Python's
# own): under 1% of the counted pages at every shape above
SLACK = 0.01


@pytest.fixture(scope="module")
def fixed_threshold():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MALLOC_MMAP_THRESHOLD_", str(pf.THRESHOLD_BYTES))
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


def _model(layers: int, dim: int, heads: int, kv: int, ffn: int):
    table = {"preset": "tiny-llama-small", "num_layers": layers, "hidden_size": dim,
             "num_attention_heads": heads, "num_kv_heads": kv, "ffn_hidden_size": ffn}  # fmt: skip
    return model_from_table(table)


def test_the_decoders_faults_are_its_counted_pages(fixed_threshold) -> None:
    """Forward and backward of the trainer's decoder with its loss: the minor faults are the
    pages of the large fresh tensors layer_bytes and outside_bytes count, forward and
    backward apart, at each shape."""
    from fault_workers import decoder_faults

    from aihpc.bench.dist import launch_local

    measured = launch_local(1, decoder_faults, SHAPES)
    for shape in SHAPES:
        layers, batch, dim, heads, kv, ffn = shape
        model, tokens = _model(layers, dim, heads, kv, ffn), batch * 128
        fwd, bwd = pf.layer_bytes(model, tokens)
        out_f, out_b = pf.outside_bytes(model, tokens)
        counted = ((layers * fwd + out_f) / pf.PAGE_BYTES, (layers * bwd + out_b) / pf.PAGE_BYTES)
        for faults, pages in zip(measured[shape], counted, strict=True):
            assert faults == pytest.approx(pages, rel=SLACK), (shape, measured[shape], counted)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_trainers_step_faults_are_its_counted_pages(fixed_threshold, micro_batches) -> None:
    """A whole step of `aihpc train`'s stepper (micro-batches, loss, clipping, AdamW), one
    rank: its minor faults are the micro-batches' counted pages and the optimizer's."""
    from fault_workers import trainer_step_faults

    from aihpc.bench.dist import launch_local

    parallel = {"global_batch_size": 4 * micro_batches, "micro_batch_size": 4, "zero_stage": 0}
    faults = launch_local(1, trainer_step_faults, parallel, 2)
    pages = pf.step_pages(model_from_table({"preset": "tiny-llama-small"}), 4 * 128, micro_batches)
    for step in faults:
        assert step == pytest.approx(pages, rel=SLACK), (faults, pages)


def _spec(gpu_extra: dict, **parallel):
    gpu = {"bf16_tflops": 0.1, "fp32_tflops": 0.1, "hbm_gib": 16, "hbm_bw_GBps": 20.0,
           "scale_up_bw_GBps": 1.0, "scale_up_domain": 2, "scale_out_bw_GBps": 1.0,
           "gpus_per_node": 2, "host_is_device": True, **gpu_extra}  # fmt: skip
    n = parallel.pop("n", 1)
    return runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small"},
            "cluster": {"num_gpus": n, "gpus_per_node": n, "gpu_spec": gpu},
            "training": {"fused_kernels": False, "dtensor_dispatch": "eager"},
            "parallel": {"global_batch_size": 8, "micro_batch_size": 4, **parallel},
        }
    )


def _step(spec) -> float:
    return estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training).step_time_s


def test_the_step_pays_the_counted_pages_at_the_measured_cost() -> None:
    """With both figures the step costs the counted bytes' pages x the share that fault x a
    fault's cost more than without them; without either (every GPU) nothing."""
    figures = {"page_fault_us": 2.0, "fresh_fault_fraction": 0.05}
    base = _step(_spec({}, zero_stage=0))
    half = _step(_spec({"page_fault_us": 2.0}, zero_stage=0))
    priced = _step(_spec(figures, zero_stage=0))
    assert half == base
    model = model_from_table({"preset": "tiny-llama-small"})
    fwd, bwd = pf.layer_bytes(model, 512)
    out_f, out_b = pf.outside_bytes(model, 512)
    per_mb = model.num_layers * (fwd + bwd) + out_f + out_b
    fresh = 2 * per_mb + pf.optimizer_bytes(model, model.num_layers)
    gpu = _spec(figures).cluster.gpu
    assert priced - base == pytest.approx(pf.fault_time_s(fresh, gpu), rel=1e-9)
    assert pf.fault_time_s(fresh, gpu) == pytest.approx(fresh / 4096 * 0.05 * 2.0e-6)


def test_a_gpu_prices_no_faults() -> None:
    """The catalog's GPUs have neither figure: their estimates do not move."""
    spec = runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small"},
            "cluster": {"num_gpus": 1, "gpu": "h100-sxm"},
            "parallel": {"global_batch_size": 8, "micro_batch_size": 4},
        }
    )
    assert not pf.priced(spec.cluster.gpu)
    gpu = dataclasses.replace(spec.cluster.gpu, page_fault_us=2.0, fresh_fault_fraction=0.1)
    assert not pf.priced(gpu)  # the host is not the device: the faults are the host's, hidden


def test_tensor_parallel_splits_the_heads_and_ffn_and_sp_the_rows() -> None:
    model = model_from_table({"preset": "tiny-llama-small"})
    one = pf.layer_bytes(model, 512)
    tp2 = pf.layer_bytes(model, 512, tp=2)
    sp2 = pf.layer_bytes(model, 512, tp=2, sp=True)
    assert tp2[0] < one[0] and sp2[0] < tp2[0]
    # the residual stream alone is split by sequence parallel
    h_rows = pf.LAYER_TENSORS["h"][0] * 4 * 512 * model.hidden_size
    assert tp2[0] - sp2[0] == pytest.approx(h_rows / 2)


def test_the_fraction_is_a_share() -> None:
    with pytest.raises(SpecError, match="fresh_fault_fraction"):
        _spec({"page_fault_us": 2.0, "fresh_fault_fraction": 1.5})
    with pytest.raises(SpecError, match="page_fault_us"):
        _spec({"page_fault_us": -1.0, "fresh_fault_fraction": 0.1})
