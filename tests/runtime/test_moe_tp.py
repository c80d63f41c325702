"""MoE under tensor parallel, with expert TP 1 (each TP rank routes its own sequence shard
through whole experts, their gradients summed over TP) alone, with expert parallel, inside
pipeline stages and with fine-grained recompute (``recompute_modules``), and with expert TP = tp
(every expert's FFN split over the TP ranks, the sequence all-gathered for the block), trained
by 4 gloo ranks (fp32 on CPU) against the same model trained by one process: the loss at each
of 4 steps, every weight and the routers' biases at the end.

Tolerance: test_moe_train's (2e-6 relative on losses, 5e-5 absolute on weights, biases equal),
for the same reason: the same mean gradient summed in another order. A fault lands far outside:
the TP sum of the MoE weights' gradients left out (each TP rank stepping with its own shard's
gradient) moved the step-2 loss of tp2-dp2-zero1 by 4.6e-5 relative (measured by breaking the
code on purpose while writing this test); under expert TP the router's gradient not summed over
TP (each rank's is a partial sum, from its slices' outputs), by 7.6e-5 on tp2-etp2-zero3.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_nd_parity import _toml, losses, model_params, train_plans
from train_cli import train as run_train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LOSS_RTOL = 2e-6
PARAM_ATOL = 5e-5
STEPS = 4
MODEL = {
    "preset": "tiny-llama",
    "seq_length": 32,
    "num_experts": 4,
    "moe_top_k": 2,
    "moe_ffn_hidden_size": 32,
    "num_shared_experts": 1,
    "moe_router_score_function": "sigmoid",
    "moe_router_topk_scaling_factor": 2.5,
    "moe_router_bias_update_rate": 0.01,
}
BASE = {
    "model": MODEL,
    "cluster": {"gpu": "h100-sxm", "num_gpus": 4, "gpus_per_node": 4},
    "training": {"train_steps": STEPS, "learning_rate": 3e-3, "warmup_steps": 2, "seed": 7},
    "checkpoint": {"interval_steps": STEPS, "async_save": False},
}
COMMON = {"micro_batch_size": 2, "global_batch_size": 8}
PLANS = {
    "tp2-dp2-zero1": {"tp": 2, "zero_stage": 1},
    "tp2-ep2-zero0": {"tp": 2, "ep": 2, "zero_stage": 0},
    "tp2-pp2": {"tp": 2, "pp": 2, "zero_stage": 1},
    "tp2-etp2-zero3": {"tp": 2, "etp": 2, "zero_stage": 3},
    "tp2-etp2-pp2": {"tp": 2, "etp": 2, "pp": 2, "zero_stage": 1, "recompute": "selective"},
    "tp2-ep2-recompute-modules": {
        "tp": 2, "ep": 2, "zero_stage": 3, "recompute_modules": ["layernorm", "moe_act"],
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    spec = d / "ref.toml"
    one = {**BASE["cluster"], "num_gpus": 1, "gpus_per_node": 1}
    parallel = {"micro_batch_size": 1, "global_batch_size": 8, "zero_stage": 0}
    spec.write_text(_toml({**BASE, "cluster": one, "parallel": parallel}))
    proc = run_train(spec, d / "run", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(d / "run"), model_params(d / "run")


@pytest.fixture(scope="module")
def plan_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("plans")
    plans = {name: {**COMMON, **table} for name, table in PLANS.items()}
    return out, train_plans(out, BASE, plans, 600)


@pytest.mark.parametrize("name", list(PLANS))
def test_moe_under_tp_matches_single_process(plan_runs, reference, name):
    out, proc = plan_runs
    result_file = out / f"{name}.json"
    assert result_file.exists(), f"plan {name} did not run:\n{proc.stderr[-3000:]}"
    result = json.loads(result_file.read_text())
    assert result["ok"], result.get("error")
    assert result["plan"]["tp"] == 2
    ref_losses, ref_params = reference
    got = losses(out / name)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, ref_losses, strict=True), 1):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: {a} vs {b}"
    params = model_params(out / name)
    assert params.keys() == ref_params.keys()
    biases = [k for k in ref_params if k.endswith("router.expert_bias")]
    assert biases and all(ref_params[k].abs().max() > 0 for k in biases)  # they moved
    for fqn, ref in ref_params.items():
        if fqn in biases:
            assert torch.equal(params[fqn], ref), fqn
        else:
            diff = (params[fqn] - ref).abs().max().item()
            assert diff <= PARAM_ATOL, f"{fqn}: max |difference| {diff:.3g}"
