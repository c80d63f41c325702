"""Export → import reproduces the run spec, for every preset and a sample of searched plans, in
each framework that can run the plan; a plan it cannot run is refused naming the field."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from typing import Any

import pytest

from aihpc.interop import deepspeed as ds
from aihpc.interop import (
    export_deepspeed,
    export_megatron,
    export_torchtitan,
    import_deepspeed,
    import_megatron,
    import_torchtitan,
    model_fields,
)
from aihpc.interop import megatron as mg
from aihpc.interop import torchtitan as tt
from aihpc.interop.deepspeed.writer import deepspeed_refusal
from aihpc.interop.megatron.runs import megatron_refusal
from aihpc.interop.megatron.writer import megatron_as_run
from aihpc.interop.torchtitan.writer import torchtitan_refusal
from aihpc.perf.search.ranking import search
from aihpc.perf.step.estimate import estimate
from aihpc.runspec import RunSpec, SpecError, TrainingSpec, model_presets, runspec_from_dict

BIG = {"gpt3-175b", "llama2-70b", "llama3-70b", "llama3-405b", "nemotron4-340b"}


def _spec(preset: str, parallel: dict[str, Any], training: dict[str, Any]) -> RunSpec:
    gpus = 256 if preset in BIG else 32
    return runspec_from_dict(
        {
            "model": {"preset": preset},
            "cluster": {"gpu": "h100-sxm", "num_gpus": gpus, "gpus_per_node": 8},
            "parallel": parallel,
            "training": training,
        }
    )


def _searched(preset: str, parallel: dict[str, Any], training: dict[str, Any], ok) -> list[RunSpec]:
    """The best few searched plans the framework can run, each as a complete run spec."""
    base = _spec(preset, {"global_batch_size": 256, "micro_batch_size": 1, **parallel}, training)
    plans = [e.plan for e in search(base, top=200).plans if ok(e.plan, base)][:3]
    if not plans:  # none fits (405B with ZeRO-3 alone): the round trip of a plan that does not
        return [replace(base, parallel=replace(base.parallel, recompute="full"))]
    return [replace(base, parallel=type(base.parallel)(**_given(p))) for p in plans]


def _given(plan: Any) -> dict[str, Any]:
    out = {f.name: getattr(plan, f.name) for f in fields(plan)}
    return out


def _comparable(spec: RunSpec, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    c = spec.cluster
    training = {
        f.name: getattr(spec.training, f.name) for f in fields(spec.training) if f.name not in skip
    }
    plan = spec.plan().as_dict()
    return {
        "model": model_fields(spec.model),
        "model_name": spec.model.name,
        "cluster": (c.gpu.id, c.num_gpus, c.gpus_per_node),
        "plan": plan,
        "training": training,
        "checkpoint": spec.checkpoint if "checkpoint" not in skip else None,
    }


def _check(original: RunSpec, back: RunSpec, fixed: dict[str, Any], skip=()) -> None:
    skip = tuple(fixed) + tuple(skip)
    assert _comparable(back, skip) == _comparable(original, skip)
    for name, value in fixed.items():
        assert getattr(back.training, name) == value, name
    # and the planner prices them the same
    assert estimate(back).step_time_s == pytest.approx(estimate(original).step_time_s, rel=1e-12)


def _megatron_ok(p: Any, spec: RunSpec) -> bool:  # the rules its export and search share
    return megatron_refusal(spec.model, p, spec.training) is None


@pytest.mark.parametrize("preset", sorted(model_presets()))
def test_megatron_round_trip(preset: str) -> None:
    # Megatron cannot leave CUDA graphs unstated: no flag is its eager default (none)
    specs = _searched(preset, {}, {"pipeline_split": "even", "cuda_graphs": "none"}, _megatron_ok)
    for spec in specs:
        script, _ = export_megatron(spec)
        back = import_megatron(script).spec()
        ran, changes = megatron_as_run(spec)
        if spec.model.vocab_size % spec.plan().tp:  # GPT-3's 50,257: Megatron pads it
            assert f"model.vocab_size = {spec.model.vocab_size} -> {ran.model.vocab_size}" in (
                changes
            )
            assert ran.model.vocab_size % (128 * spec.plan().tp) == 0
        # the import reads back what Megatron runs: the spec with the fields it fixes as it
        # runs them (its even split prices as the spec's when the layers divide)
        _check(ran, back, {k: v for k, v in mg.FIXED.items() if k != "pipeline_split"})


def _titan_ok(p: Any, spec: RunSpec) -> bool:
    return torchtitan_refusal(spec.model, p, spec.training) is None


@pytest.mark.parametrize("preset", sorted(model_presets()))
def test_torchtitan_round_trip(preset: str) -> None:
    training = {"attention": "flash2", "kv_repeat": True, "fused_kernels": False}
    training["cross_entropy"] = "eager"
    training["tp_comm_overlap"] = "none"  # vanilla DTensor TP
    if not preset.startswith("llama3-"):
        spec = _spec(preset, {"global_batch_size": 512, "zero_stage": 3}, training)
        with pytest.raises(SpecError) as err:
            export_torchtitan(spec)
        assert err.value.field == "model" and "llama3 flavors" in str(err.value)
        return
    for spec in _searched(preset, {"zero_stage": 3}, training, _titan_ok):
        text, dropped = export_torchtitan(spec)
        assert dropped == []
        back = import_torchtitan(text).spec()
        _check(spec, back, tt.FIXED, skip=("seed",) if False else ())


def _ds_ok(p: Any, spec: RunSpec) -> bool:
    return deepspeed_refusal(spec.model, p, spec.training) is None


@pytest.mark.parametrize("preset", sorted(model_presets()))
def test_deepspeed_round_trip(preset: str) -> None:
    parallel = {"tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False}
    if preset in ("gpt3-175b",):  # learned positions: a Llama-style config.json cannot say it
        with pytest.raises(SpecError) as err:
            export_deepspeed(_spec(preset, {"global_batch_size": 1024, **parallel}, {}))
        assert err.value.field == "model.position_embedding"
        return
    if preset in BIG:
        parallel["zero_stage"] = 3
    if model_presets()[preset].get("num_experts"):
        parallel["ep"] = 1  # the plain engine has no expert parallelism
    for spec in _searched(preset, parallel, {}, _ds_ok):
        config, model_json, dropped = export_deepspeed(spec)
        assert dropped == []
        back = import_deepspeed(config, model_text=model_json).spec()
        skip = ("seed",)  # nothing to compare: the spec's default either way
        _check(spec, back, ds.FIXED, skip=(*skip, "checkpoint"))
        by_name = import_deepspeed(config, model=preset).spec()
        _check(spec, by_name, ds.FIXED, skip=(*skip, "checkpoint"))


def test_refusals_are_one_line_naming_the_field() -> None:
    spec = _spec("llama3-8b", {"tp": 4, "pp": 2, "global_batch_size": 64, "zero_stage": 2}, {})
    cases = [
        (export_megatron, spec, "parallel.zero_stage"),
        (export_deepspeed, spec, "parallel.tp"),
        (
            export_torchtitan,
            _spec("llama3-8b", {"tp": 2, "global_batch_size": 64, "zero_stage": 1}, {}),
            "parallel.zero_stage",
        ),
        (
            export_megatron,
            _spec(
                "llama3-405b",
                {"tp": 8, "pp": 8, "global_batch_size": 512},
                {"pipeline_split": "even"},
            ),
            "training.pipeline_split",  # 126 layers do not split evenly over 8 stages
        ),
        (  # Megatron-LM's FSDP2 asserts pp 1 (arguments.py:1034 at d98e8a6)
            export_megatron,
            _spec("llama3-8b", {"tp": 4, "pp": 2, "global_batch_size": 64, "zero_stage": 3}, {}),
            "parallel.pp",
        ),
    ]
    for export, s, field in cases:
        with pytest.raises(SpecError) as err:
            export(s)
        assert err.value.field == field
        assert "\n" not in str(err.value)


def test_moe_refusals_name_the_field() -> None:
    """What Megatron-LM or the plain DeepSpeed engine cannot say about a mixture of experts is
    refused naming the field, not dropped."""
    moe = {"tp": 1, "pp": 1, "ep": 1, "global_batch_size": 256}
    cases = [
        (export_megatron, "mixtral-8x7b", {**moe, "ep": 8, "moe_a2a_overlap": "dualpipe"}, {},
         {}, "parallel.moe_a2a_overlap"),
        (export_megatron, "mixtral-8x7b", {**moe, "ep": 8}, {"moe_dispatch_dtype": "fp8"}, {},
         "training.moe_dispatch_dtype"),
        (export_deepspeed, "mixtral-8x7b", {**moe, "ep": 4}, {}, {}, "parallel.ep"),
        (export_deepspeed, "mixtral-8x7b", {**moe, "moe_a2a_overlap": "1f1b"}, {}, {},
         "parallel.moe_a2a_overlap"),
        (export_deepspeed, "mixtral-8x7b", moe, {}, {"moe_capacity_factor": 1.0},
         "model.moe_capacity_factor"),
        (export_deepspeed, "deepseek-v3", moe, {}, {"moe_router_bias_update_rate": 0.001},
         "model.moe_router_bias_update_rate"),
    ]  # fmt: skip
    for export, preset, parallel, training, model, field in cases:
        spec = runspec_from_dict(
            {
                "model": {"preset": preset, **model},
                "cluster": {"gpu": "h100-sxm", "num_gpus": 32},
                "parallel": parallel,
                "training": training,
            }
        )
        with pytest.raises(SpecError) as err:
            export(spec)
        assert err.value.field == field
        assert "\n" not in str(err.value)


def test_deepspeed_model_json_carries_moe_and_mla() -> None:
    """The config.json written for an MoE / MLA model uses the Hugging Face key names."""
    spec = _spec("deepseek-v3", {"tp": 1, "pp": 1, "ep": 1, "global_batch_size": 256}, {})
    _, model_json, _ = export_deepspeed(spec)
    config = json.loads(model_json)
    m = spec.model
    assert config["model_type"] == "deepseek_v3"
    assert config["n_routed_experts"] == m.num_experts
    assert config["first_k_dense_replace"] == m.first_dense_layers
    assert config["kv_lora_rank"] == m.kv_lora_rank and config["q_lora_rank"] == m.q_lora_rank
    assert config["n_group"] == m.moe_router_groups
    assert config["num_nextn_predict_layers"] == m.mtp_layers
    _, mixtral, _ = export_deepspeed(_spec("mixtral-8x7b", {"ep": 1, "global_batch_size": 256}, {}))
    assert json.loads(mixtral)["num_local_experts"] == 8


def test_training_defaults_differ_per_framework() -> None:
    """An import with no training flags applies the framework's defaults, not aihpc's."""
    assert TrainingSpec().adam_beta2 == 0.95
    megatron = import_megatron(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 1 --vocab-size 256 --bf16 --lr 1e-3",
        num_gpus=8,
    ).spec()
    assert megatron.training.adam_beta2 == 0.999  # Megatron's default
    assert megatron.training.weight_decay == 0.01
    assert megatron.training.dropout == 0.1
    assert megatron.training.log_interval == 100
    assert megatron.model.vocab_size == 256  # 256 is a multiple of 128 x tp 1
    assert megatron.plan().global_batch_size == 8  # micro-batch x dp
    titan = import_torchtitan('[model]\nname = "llama3"\nflavor = "8B"\n', num_gpus=8).spec()
    assert titan.plan().micro_batch_size == 8 and titan.plan().global_batch_size == 64
    assert titan.model.seq_length == 2048 and titan.training.learning_rate == 8e-4
    assert titan.plan().recompute == "full"  # selective_ac_option "2", priced as full
    assert titan.plan().zero_stage == 3  # FSDP over every rank left


@pytest.mark.parametrize(
    ("model", "parallel", "training"),
    [
        (  # a mixture of experts with a shared expert and a dense first layer
            {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "num_kv_heads": 4,
             "ffn_hidden_size": 4096, "ffn_activation": "swiglu", "vocab_size": 32768,
             "seq_length": 4096, "num_experts": 16, "moe_top_k": 2, "moe_ffn_hidden_size": 1024,
             "num_shared_experts": 1, "first_dense_layers": 1},
            {"tp": 2, "pp": 2, "ep": 4, "global_batch_size": 256, "zero_stage": 1,
             "recompute": "selective"},
            {"dropout": 0.1, "cross_entropy": "vocab_parallel", "grad_reduce_overlap": False,
             "moe_expert_gemm": "per_expert", "cuda_graphs": "none"},
        ),
        (  # MLA, grouped sigmoid routing with expert bias, MTP, Llama 4's interleaved MoE
            {"num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16,
             "ffn_hidden_size": 4096, "ffn_activation": "swiglu", "vocab_size": 32768,
             "seq_length": 4096, "num_experts": 16, "moe_top_k": 4, "moe_ffn_hidden_size": 512,
             "num_shared_experts": 1, "first_dense_layers": 1, "moe_layer_freq": 2,
             "moe_capacity_factor": 1.25, "moe_router_groups": 4, "moe_router_group_topk": 2,
             "q_lora_rank": 384, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
             "qk_rope_head_dim": 32, "v_head_dim": 64, "mtp_layers": 1,
             "moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5,
             "moe_router_bias_update_rate": 0.001, "moe_aux_loss_coeff": 0.0001},
            {"tp": 2, "pp": 2, "ep": 8, "etp": 2, "global_batch_size": 256,
             "moe_a2a_overlap": "1f1b", "recompute_modules": ["mla_up_proj", "moe_act"]},
            {"moe_dispatcher": "hierarchical", "cuda_graphs": "partial"},
        ),
        (  # FP8 with its options, context parallel with all-gather, FSDP2, full recompute
            {"preset": "llama3-70b"},
            {"tp": 4, "pp": 1, "cp": 2, "global_batch_size": 512, "zero_stage": 3,
             "recompute": "full", "offload_layers": 0},
            {"precision": "fp8", "fp8_param_gather": True, "grad_reduce_dtype": "bf16",
             "optimizer_dtype": "bf16", "attention": "flash2", "cp_exchange": "allgather",
             "learning_rate": 1e-4, "min_lr_ratio": 0.05, "warmup_steps": 7, "seed": 42,
             "cuda_graphs": "full"},
        ),
    ],
)  # fmt: skip
def test_megatron_round_trip_of_every_option(model: dict, parallel: dict, training: dict) -> None:
    spec = runspec_from_dict(
        {
            "model": model,
            "cluster": {"gpu": "h100-sxm", "num_gpus": 256},
            "parallel": parallel,
            "training": {"pipeline_split": "even", **training},
            "checkpoint": {"interval_steps": 250},
        }
    )
    script, _ = export_megatron(spec)
    back = import_megatron(script).spec()
    ran, _ = megatron_as_run(spec)  # MoE: TEGroupedMLP, per_expert GEMMs
    _check(ran, back, {k: v for k, v in mg.FIXED.items() if k != "pipeline_split"})


def test_tp_comm_overlap_travels_as_each_framework_spells_it() -> None:
    """Megatron's --tp-comm-overlap is Transformer Engine's userbuffers (without it, its default
    backward overlap); torchtitan's enable_async_tensor_parallel is async TP (without it, vanilla
    DTensor TP overlaps nothing). A value the framework cannot run is reported, not dropped
    silently; async TP without compile is refused."""
    parallel = {"tp": 4, "sequence_parallel": True, "global_batch_size": 64, "zero_stage": 1}
    spec = _spec("llama3-8b", parallel, {"tp_comm_overlap": "userbuffers"})
    script, dropped = export_megatron(spec)
    assert "--tp-comm-overlap" in script and dropped == []
    assert import_megatron(script).spec().training.tp_comm_overlap == "userbuffers"
    default, _ = export_megatron(_spec("llama3-8b", parallel, {}))
    assert import_megatron(default).spec().training.tp_comm_overlap == "backward"
    _, dropped = export_megatron(_spec("llama3-8b", parallel, {"tp_comm_overlap": "async_tp"}))
    assert dropped and "training.tp_comm_overlap = 'async_tp'" in dropped[0]

    titan = {"zero_stage": 3, "tp": 4, "sequence_parallel": True, "global_batch_size": 64}
    compiled = {"tp_comm_overlap": "async_tp", "fused_kernels": True, "cross_entropy": "fused"}
    compiled |= {"attention": "flash2", "kv_repeat": True}
    text, dropped = export_torchtitan(_spec("llama3-8b", titan, compiled))
    assert "enable_async_tensor_parallel = true" in text and dropped == []
    assert import_torchtitan(text).spec().training.tp_comm_overlap == "async_tp"
    _, dropped = export_torchtitan(
        _spec("llama3-8b", titan, {**compiled, "tp_comm_overlap": "backward"})
    )
    assert any("training.tp_comm_overlap = 'backward'" in d for d in dropped)
    with pytest.raises(SpecError) as err:
        export_torchtitan(_spec("llama3-8b", titan, {**compiled, "fused_kernels": False}))
    assert err.value.field == "training.tp_comm_overlap"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("", "none"),  # TransformerConfig.cuda_graph_impl defaults to "none"
        ("--cuda-graph-impl none", "none"),
        ("--cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router "
         "moe_preprocess", "partial"),
        ("--cuda-graph-impl local", "partial"),  # no modules: each whole layer, one graph
        ("--cuda-graph-impl local --cuda-graph-scope full", "partial"),  # deprecated "full"
        ("--enable-cuda-graph", "partial"),  # deprecated: local
        ("--external-cuda-graph --cuda-graph-scope attn", "partial"),  # deprecated: TE
        ("--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad", "full"),
        ("--cuda-graph-impl local --cuda-graph-scope full_iteration", "full"),  # migrated
    ],
)  # fmt: skip
def test_megatron_import_of_cuda_graphs(flags: str, expected: str) -> None:
    spec = _spec("deepseek-v3", {"tp": 1, "pp": 1, "ep": 8, "global_batch_size": 256}, {})
    script, _ = export_megatron(spec)
    imported = import_megatron(f"{script.rstrip()} {flags}")
    assert imported.spec().training.cuda_graphs == expected
    assert not [f for f in imported.unpriced if "cuda-graph" in f or "check-for-nan" in f]


def test_megatron_export_of_unknown_cuda_graphs_emits_no_flag() -> None:
    spec = _spec("deepseek-v3", {"tp": 1, "pp": 1, "ep": 8, "global_batch_size": 256}, {})
    assert spec.training.cuda_graphs == "unknown"
    script, _ = export_megatron(spec)
    assert "cuda-graph" not in script
    assert import_megatron(script).spec().training.cuda_graphs == "none"


def test_megatron_import_refuses_an_unknown_cuda_graph_impl() -> None:
    spec = _spec("llama3-8b", {"tp": 2, "global_batch_size": 64}, {})
    script, _ = export_megatron(spec)
    with pytest.raises(SpecError) as err:
        import_megatron(f"{script.rstrip()} --cuda-graph-impl cudnn")
    assert err.value.field == "--cuda-graph-impl"
