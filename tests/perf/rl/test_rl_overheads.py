"""What an RL step spends beside the phase models' GPU work (perf/rl/overheads.py): each figure
a published component measurement with its source, the engine's host work paid on every decode
step, the colocated switch only when colocated, the trainer's orchestration on the
training side, the host-copy rates of the colocated switch, and a ceiling from the model's
published pre-training rate on that GPU."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from importlib import resources

import pytest
from rl_base_spec import base_spec as _spec

from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.infer.rollout import LengthDist, estimate_rollout
from aihpc.perf.rl import estimate_rl
from aihpc.perf.rl.overheads import overheads, training_ceiling_s
from aihpc.perf.rl.step import TRAIN_SIDE
from aihpc.runspec.cluster import gpu_from_id
from aihpc.runspec.model import model_from_table


def test_every_figure_names_a_published_source():
    text = resources.files("aihpc.perf.rl").joinpath("data/overheads.toml").read_text()
    table = tomllib.loads(text)
    rows = [table[k] for k in ("engine_step", "orchestration")]
    rows += table["training_ceiling"] + table["host_copy"]
    assert all(len(r["source"]) > 40 for r in rows)
    o = overheads()
    assert 0 < o.engine_step_s < 0.1 and o.orchestration_s > 0
    assert o.pageable_GBps and all(min(r) > 0 for r in o.pageable_GBps.values())


def test_the_engines_host_work_is_paid_on_every_decode_step():
    model = model_from_table({"preset": "llama3-8b"})
    args = {"prompts": 16, "samples": 4, "prompt_len": 256, "instances": 2}
    lengths = LengthDist(kind="uniform", low=100, high=2000)
    gpu, plan = gpu_from_id("h100-sxm"), ServingPlan(tp=1)
    bare = estimate_rollout(model, gpu, plan, response=lengths, **args)
    host = estimate_rollout(model, gpu, plan, response=lengths, host_step_s=0.004, **args)
    # the longest response's decode steps run one after another, each paying the host's share
    assert host.phase_s - bare.phase_s >= 0.004 * bare.longest_response * 0.99
    assert host.tokens_per_s_per_gpu < bare.tokens_per_s_per_gpu


def test_the_switch_only_when_colocated():
    colocated = estimate_rl(_spec())
    apart = estimate_rl(_spec(placement="disaggregated", rollout_gpus=16))
    assert colocated.phases_s["switch"] > 0.0 and colocated.switch_gib > 0.0
    assert apart.phases_s["switch"] == 0.0 and apart.switch_by_timer == {}


def test_orchestration_is_on_the_training_side():
    assert "orchestration" in TRAIN_SIDE
    sync = estimate_rl(_spec())
    assert sync.phases_s["orchestration"] == pytest.approx(overheads().orchestration_s)
    assert sync.step_time_s == pytest.approx(sum(sync.phases_s.values()))


def test_the_published_pretraining_rate_bounds_the_update():
    spec = _spec()
    est = estimate_rl(spec)
    rl = spec.rl
    tokens = rl.samples_per_step * (rl.prompt_len + rl.response_len)
    floor = training_ceiling_s(spec.model, spec.training_cluster(), tokens, 32)
    assert floor > 0  # Qwen3-30B-A3B on H100 has a published row
    assert est.phases_s["update"] >= floor
    assert est.phases_s["old_logprob"] >= floor / 3
    # no row for this model on this GPU: no ceiling
    other = _spec(model="llama3-8b", gpu="h100-sxm", rollout={"tp": 1})
    assert training_ceiling_s(other.model, other.training_cluster(), tokens, 32) == 0.0


def test_the_ceiling_is_paid_on_the_tokens_the_update_computes():
    """Padded micro-batches compute their padding too: the ceiling (a rate of computed tokens,
    pre-training's packed 4K sequences) counts the samples' tokens over the share they fill."""
    from aihpc.perf.rl.step import computed_tokens

    spec = _spec()
    rl = spec.rl
    samples = rl.samples_per_step * (rl.prompt_len + rl.response_len)
    packed = estimate_rl(spec, batching="packed")
    padded = estimate_rl(spec, batching="padded")
    assert padded.actor.batches.useful < 1.0  # the responses are shorter than the longest
    computed = computed_tokens(rl, padded.actor)
    assert computed == pytest.approx(samples / padded.actor.batches.useful)
    # every padded sequence is as long as the step's longest: seq x samples tokens
    assert computed == pytest.approx(padded.actor.batches.seq * rl.samples_per_step, rel=1e-6)
    floor = training_ceiling_s(spec.model, spec.training_cluster(), computed, 32)
    assert padded.phases_s["update"] >= floor
    assert padded.phases_s["old_logprob"] >= floor / 3
    assert padded.phases_s["update"] > packed.phases_s["update"]


def test_the_ceiling_is_the_rate_published_for_the_runs_moe_stack():
    """A published pre-training rate that names its MoE stack bounds the runs on that stack; a
    run on a stack no row names (or not stated) is bounded by the fastest row, as before."""
    from aihpc.perf.rl.overheads import ceiling_rate

    spec = _spec()
    cluster = spec.training_cluster()
    rows = [c for c in overheads().ceilings[(spec.model.name, cluster.gpu.id)] if not c.token_drop]
    stacks = {c.stack for c in rows if c.stack}
    assert len(stacks) >= 2  # the same model and GPU measured on two dispatchers
    fastest = max(c.rate for c in rows)
    for stack in stacks:
        own = max(c.rate for c in rows if c.stack == stack)
        assert ceiling_rate(spec.model, cluster, stack) == own
    assert ceiling_rate(spec.model, cluster, "unknown") == fastest
    assert ceiling_rate(spec.model, cluster, "torch-deepep") == fastest  # no row of its own
    slowest = min(c.rate for c in rows if c.stack)
    stack = next(c.stack for c in rows if c.rate == slowest)
    tokens = 1e6
    assert training_ceiling_s(spec.model, cluster, tokens, 8, stack) == pytest.approx(
        tokens / (slowest * 8)
    )
    # the RL step pays the ceiling of the stack its [training] names
    data = {"moe_stack": stack, "cuda_graphs": "none"}
    on_stack = estimate_rl(replace(spec, training=replace(spec.training, **data)))
    rl = spec.rl
    floor = training_ceiling_s(
        spec.model, cluster, rl.samples_per_step * (rl.prompt_len + rl.response_len), 32, stack
    )
    assert on_stack.phases_s["update"] >= floor


def _with_ceilings(monkeypatch, rows):
    """overheads() with these [[training_ceiling]] rows for (qwen3-30b-a3b, the GPU) only."""
    from aihpc.perf.rl import overheads as mod

    base = mod.overheads()
    table = dict(base.ceilings)
    table.update(rows)
    monkeypatch.setattr(mod, "overheads", lambda: replace(base, ceilings=table))


def test_a_token_dropping_rate_bounds_only_its_own_stack_and_only_without_a_dropless_one(
    monkeypatch,
):
    """A dropless run on a stack is bounded by that stack's dropless rate; where the stack was
    published only with dropped tokens, by that (faster, so looser) rate; a token-dropping rate
    never bounds another stack's run, nor a run whose stack is unknown."""
    from aihpc.perf.rl.overheads import Ceiling, ceiling_rate

    spec = _spec()
    cluster = spec.training_cluster()
    key = (spec.model.name, cluster.gpu.id)
    alltoall_drop = Ceiling(9000.0, "megatron-alltoall", token_drop=True)
    alltoall = Ceiling(4000.0, "megatron-alltoall")
    hybridep = Ceiling(7000.0, "megatron-hybridep")
    _with_ceilings(monkeypatch, {key: [alltoall_drop, alltoall, hybridep]})
    assert ceiling_rate(spec.model, cluster, "megatron-alltoall") == alltoall.rate
    assert ceiling_rate(spec.model, cluster, "megatron-hybridep") == hybridep.rate
    assert ceiling_rate(spec.model, cluster, "unknown") == hybridep.rate
    _with_ceilings(monkeypatch, {key: [alltoall_drop, hybridep]})
    assert ceiling_rate(spec.model, cluster, "megatron-alltoall") == alltoall_drop.rate
    assert ceiling_rate(spec.model, cluster, "megatron-deepep") == hybridep.rate
    assert ceiling_rate(spec.model, cluster, "unknown") == hybridep.rate
    _with_ceilings(monkeypatch, {key: [alltoall_drop]})  # nothing else published
    assert ceiling_rate(spec.model, cluster, "unknown") == alltoall_drop.rate


def test_the_published_token_drop_pair_runs_faster_than_dropless_on_the_same_stack():
    """The direction the rule relies on, in the data: where Megatron-Bridge published the same
    model, GPU and alltoall layout both ways (Qwen3-30B-A3B on 16 H100), the token-dropping
    rate is the faster; and every GB200 MoE row of the RL validation has an alltoall bound."""
    rows = overheads().ceilings[("qwen3-30b-a3b", "h100-sxm")]
    drop = [c.rate for c in rows if c.stack == "megatron-alltoall" and c.token_drop]
    dropless = [c.rate for c in rows if c.stack == "megatron-alltoall" and not c.token_drop]
    assert drop and dropless and min(drop) > max(dropless)
    for model in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"):
        gb200 = overheads().ceilings[(model, "gb200")]
        assert any(c.stack == "megatron-alltoall" and c.token_drop for c in gb200)
    dropped = [v for k, v in overheads().sources.items() if " token-drop " in k]
    assert len(dropped) == 6 and all("(tokendrop)" in v and "alltoall" in v for v in dropped)


def _host_cpu_table() -> tuple[float, dict[str, float], float]:
    """[engine_step] seconds, gpu id -> its [[host_cpu]] row's eager-call time, and the one
    reference row's time, read from the data files themselves (the host table is the GPU
    catalog's, runspec/data/host_cpus.toml, which the training step's host issue reads too)."""
    text = resources.files("aihpc.perf.rl").joinpath("data/overheads.toml").read_text()
    table = tomllib.loads(text)
    hosts = resources.files("aihpc.runspec").joinpath("data/host_cpus.toml").read_text()
    rows = tomllib.loads(hosts)["host_cpu"]
    assert all(len(r["source"]) > 40 and r["torch_op_cpu_us"] > 0 for r in rows)
    refs = [r for r in rows if r.get("reference")]
    assert len(refs) == 1
    times = {gpu: float(r["torch_op_cpu_us"]) for r in rows for gpu in r["gpus"]}
    return float(table["engine_step"]["seconds"]), times, float(refs[0]["torch_op_cpu_us"])


def test_the_engine_step_on_each_host_scales_by_its_host_cpu_row():
    """The host time per decode step of GB200 (a Grace host) and of H100 (the x86 reference host)
    is [engine_step] times the [[host_cpu]] row's eager-call time over the reference row's; a GPU
    no row names (b200) pays [engine_step] unscaled."""
    from aihpc.perf.rl.overheads import engine_step_s

    base, times, ref = _host_cpu_table()
    assert "gb200" in times and "h100-sxm" in times and "b200" not in times
    for gpu in ("h100-sxm", "gb200", "b200"):
        cluster = _spec(gpu=gpu).training_cluster()
        assert engine_step_s(cluster) == pytest.approx(base * times.get(gpu, ref) / ref)
    gb200 = engine_step_s(_spec(gpu="gb200").training_cluster())
    h100 = engine_step_s(_spec(gpu="h100-sxm").training_cluster())
    assert gb200 / h100 == pytest.approx(times["gb200"] / times["h100-sxm"])


def test_the_rollout_pays_its_hosts_engine_step_on_every_decode_step(monkeypatch):
    """Priced on a GB200, the rollout hands the engine model the Grace host's engine step; with
    the [[host_cpu]] rows removed (every host at [engine_step]) the same rollout is shorter by at
    least the longest response's decode steps times the difference."""
    from aihpc.perf.rl import overheads as mod
    from aihpc.perf.rl import rollout as rl_rollout

    seen: list[float] = []
    real = rl_rollout.estimate_rollout

    def spy(*args, **kwargs):
        seen.append(kwargs["host_step_s"])
        return real(*args, **kwargs)

    monkeypatch.setattr(rl_rollout, "estimate_rollout", spy)
    spec = _spec(gpu="gb200")
    cluster = spec.training_cluster()
    scaled = rl_rollout.price_rollout(spec.model, cluster, spec.rl, cluster.num_gpus)
    base = mod.overheads()
    ratio = mod.host_cpu_ratio("gb200")
    assert ratio > 1.0  # a Grace host (runspec/data/host_cpus.toml)
    assert seen and all(h == pytest.approx(base.engine_step_s * ratio) for h in seen)
    seen.clear()
    monkeypatch.setattr(mod, "host_cpu_ratio", lambda gpu: 1.0)  # no [[host_cpu]] rows
    flat = rl_rollout.price_rollout(spec.model, cluster, spec.rl, cluster.num_gpus)
    assert seen and all(h == pytest.approx(base.engine_step_s) for h in seen)
    extra = (ratio - 1.0) * base.engine_step_s * flat.infer.longest_response
    assert scaled.time_s - flat.time_s >= extra * 0.99
