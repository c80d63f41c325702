"""The planner prices the model the trainer builds: parameter count and training FLOPs per token
of aihpc.perf equal those of aihpc.runtime's Llama, counted by torch's FlopCounterMode over a
real forward + backward (SDPA's math backend, which computes the full score square the planner
counts; the planner's MFU convention is documented in docs/performance-model.md)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from aihpc.perf.step.flops import model_flops_per_token, num_params  # noqa: E402
from aihpc.runspec import ModelSpec  # noqa: E402
from aihpc.runspec.model import model_from_table  # noqa: E402
from aihpc.runtime.model import Llama, LlamaConfig  # noqa: E402

CASES = {
    "tiny-llama (GQA)": {"preset": "tiny-llama"},
    "MHA, 3 layers, seq 48": {
        "preset": "tiny-llama",
        "num_layers": 3,
        "num_kv_heads": 4,
        "seq_length": 48,
    },
    "tied embeddings": {"preset": "tiny-llama", "tied_embeddings": True},
}


def _model(spec: ModelSpec) -> Llama:
    model = Llama(LlamaConfig.from_spec(spec))
    model.init_weights(seed=0)
    return model


@pytest.mark.parametrize("table", list(CASES.values()), ids=list(CASES))
def test_planner_counts_equal_the_trainers_model(table: dict) -> None:
    spec = model_from_table(table)
    model = _model(spec)
    assert sum(p.numel() for p in model.parameters()) == num_params(spec)
    batch, seq = 2, spec.seq_length
    tokens = torch.randint(0, spec.vocab_size, (batch, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        logits.float().sum().backward()
    measured = counter.get_total_flops() / (batch * seq)
    assert measured == pytest.approx(model_flops_per_token(spec), rel=1e-12)


@pytest.mark.parametrize("pp", [2, 4])
def test_the_planners_stage_parameters_are_the_trainers_stages(pp: int) -> None:
    """``aihpc estimate``'s per-stage parameters equal the trainer's model cut into pp stages of
    whole layers: the embedding with the first, the final norm and output layer with the last."""
    from dataclasses import replace

    from aihpc.perf.step.param_counts import param_counts
    from aihpc.runspec.parallel import ParallelPlan

    spec = model_from_table({"preset": "tiny-llama-small"})  # 4 layers
    model = _model(spec)
    plan = ParallelPlan(pp=pp, dp=1, global_batch_size=pp, micro_batch_size=1)
    per = spec.num_layers // pp
    layer = [sum(p.numel() for p in model.layers[str(i)].parameters()) for i in range(per)]
    first = sum(layer) + model.tok_embeddings.weight.numel()
    last = sum(layer) + model.norm.weight.numel() + model.output.weight.numel()
    counts = param_counts(spec, plan)
    assert (counts.first_stage, counts.last_stage) == (first, last)
    assert counts.per_gpu == first  # tp 1: the first stage's rank holds all of it
    assert param_counts(spec, replace(plan, pp=1)).per_gpu == num_params(spec)
