"""An eager rollout engine (``[rl.rollout] cuda_graphs = false``, vLLM's enforce_eager): every
decode step takes no less than the host's issue of its counted kernels from Python
(perf/infer/kernels.py host_issue_s), the tail's small batches pay it; the field reaches the
spec from TOML, from a validation row's ``rollout_cuda_graphs`` column and from verl's config."""

from __future__ import annotations

import copy

import pytest
from rl_base_spec import BASE, base_spec

from aihpc.interop.verl import import_verl
from aihpc.perf.fit.rl_validate import rl_runspec
from aihpc.perf.infer.estimate import engine_for
from aihpc.perf.infer.kernels import (
    KERNELS_PER_LAYER,
    KERNELS_PER_MOE_LAYER,
    Work,
    host_issue_s,
    stage_layer_counts,
)
from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.infer.software import software_for
from aihpc.perf.infer.step import step_time
from aihpc.perf.rl.rollout import price_rollout, serving_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import SpecError, runspec_from_dict

VERL = (
    "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
    "actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B actor_rollout_ref.rollout.n=8 "
    "data.max_response_length=4096 trainer.nnodes=2"
)


def _engine(cuda_graphs: bool, engine: str = "default"):
    spec = base_spec()
    sw = software_for(engine, cuda_graphs=cuda_graphs)
    return engine_for(spec.model, spec.cluster.gpu, ServingPlan(tp=2, software=sw))


def test_eager_decode_pays_each_layer_at_the_published_host_cost():
    e, cluster = _engine(cuda_graphs=False)
    one = Work(decode_seqs=1, decode_ctx=1000.0)
    dense, moe = stage_layer_counts(e.model, e.plan.pp)
    assert moe == 48 and dense == 0  # Qwen3-30B-A3B: every layer routes
    p = e.params
    host = dense * KERNELS_PER_LAYER * p.host_eager_op_s + moe * p.host_eager_moe_layer_s
    assert host_issue_s(e, one) == pytest.approx(host) and host > 0
    # an MoE layer costs the host more than its counted kernels at one eager op each
    assert p.host_eager_moe_layer_s > KERNELS_PER_MOE_LAYER * p.host_eager_op_s
    eager = step_time(e, cluster, one)
    e_graph, _ = _engine(cuda_graphs=True)
    graphed = step_time(e_graph, cluster, one)
    # the step is the longer of the GPU's work and the host's issue of its kernels
    assert eager.total == pytest.approx(max(graphed.total, host))
    assert eager.total >= host
    terms = eager.terms()
    assert sum(terms.values()) == pytest.approx(eager.total)
    assert terms["host_wait"] == pytest.approx(max(host - graphed.total, 0.0))


def test_the_moe_layer_figure_is_the_published_steps_arithmetic():
    # vllm-project/vllm #17469: vLLM 0.8.5 enforce_eager, Qwen3-30B-A3B (48 MoE layers), one
    # sequence, 20 tokens/s; CUDA-graphed on the same 4 A10 (SGLang 0.4.6), 60 tokens/s
    per_layer = (1 / 20 - 1 / 60) / 48
    assert DEFAULT_PARAMS.host_eager_moe_layer_s == pytest.approx(per_layer, rel=0.01)
    # the other published eager MoE steps put it no lower (sgl-project/sglang #1369: 31 against
    # 8 ms a token, DeepSeek-Coder-V2-Lite's 26 MoE layers): it is the lowest, a lower bound
    assert DEFAULT_PARAMS.host_eager_moe_layer_s <= (31e-3 - 8e-3) / 26


def test_a_dense_eager_layer_keeps_its_counted_kernels():
    spec = base_spec(model="llama3-8b")
    sw = software_for("default", cuda_graphs=False)
    e, _ = engine_for(spec.model, spec.cluster.gpu, ServingPlan(tp=1, software=sw))
    host = host_issue_s(e, Work(decode_seqs=1, decode_ctx=100.0))
    assert host == pytest.approx(32 * KERNELS_PER_LAYER * e.params.host_eager_op_s)


def test_graphs_or_a_cpp_runtime_issue_nothing_from_python():
    e, _ = _engine(cuda_graphs=True)
    assert host_issue_s(e, Work(decode_seqs=1)) == 0.0
    cpp, _ = _engine(cuda_graphs=False, engine="trtllm-0.5")  # a C++ runtime enqueues
    assert host_issue_s(cpp, Work(decode_seqs=1)) == 0.0


def test_a_large_batch_is_gpu_bound_either_way():
    e, cluster = _engine(cuda_graphs=False)
    g, _ = _engine(cuda_graphs=True)
    big = Work(decode_seqs=512, decode_ctx=4000.0)
    assert step_time(g, cluster, big).total > host_issue_s(e, big)
    assert step_time(e, cluster, big).total == pytest.approx(step_time(g, cluster, big).total)


def _small(**rollout: object):
    """BASE with 8 samples a step: each rollout engine decodes one sequence at a time."""
    data = copy.deepcopy(BASE)
    data["parallel"]["global_batch_size"] = 8
    data["rl"].update(prompts_per_step=4, samples_per_prompt=2)
    data["rl"]["rollout"].update(rollout)
    return runspec_from_dict(data)


def test_the_rl_field_reaches_the_rollout_engine_and_costs_time():
    graphed, eager = _small(), _small(cuda_graphs=False)
    assert graphed.rl.rollout.cuda_graphs and not eager.rl.rollout.cuda_graphs
    assert not serving_plan(eager.model, eager.rl).software.cuda_graphs
    fast = price_rollout(graphed.model, graphed.cluster, graphed.rl, 32)
    slow = price_rollout(eager.model, eager.cluster, eager.rl, 32)
    assert slow.time_s > fast.time_s


def test_a_bad_value_is_one_error_naming_the_field():
    data = copy.deepcopy(BASE)
    data["rl"]["rollout"]["cuda_graphs"] = "no"
    with pytest.raises(SpecError) as err:
        runspec_from_dict(data)
    assert err.value.field == "rl.rollout.cuda_graphs"


def test_a_validation_row_sets_it_from_its_column():
    row = {
        "id": "x", "placement": "colocated", "gpu_memory_utilization": "0.6", "model": "x",
        "rollout_cuda_graphs": "false",
    }  # fmt: skip
    row.update({k: "1" for k in ("num_gpus", "rollout_gpus", "staleness", "prompts_per_step")})
    row.update({k: "1" for k in ("samples_per_prompt", "prompt_len", "response_len")})
    row.update({k: "1" for k in ("max_response_len", "rollout_tp", "train_tp", "train_cp")})
    row.update({k: "1" for k in ("train_ep", "train_pp", "train_gbs")})
    row.update({"gpu": "h100-sxm", "recompute": "none"})
    assert rl_runspec(row)["rl"]["rollout"]["cuda_graphs"] is False
    row["rollout_cuda_graphs"] = ""
    assert "cuda_graphs" not in rl_runspec(row)["rl"]["rollout"]
    row["rollout_cuda_graphs"] = "maybe"
    with pytest.raises(SpecError):
        rl_runspec(row)


def test_verl_enforce_eager_maps_to_no_cuda_graphs():
    default = import_verl(VERL).tables["rl"]["rollout"]
    assert default["cuda_graphs"] is True  # verl's rollout default since ff6978c: graphs
    eager = import_verl(VERL + " actor_rollout_ref.rollout.enforce_eager=True")
    assert eager.tables["rl"]["rollout"]["cuda_graphs"] is False
    assert not eager.spec().rl.rollout.cuda_graphs
