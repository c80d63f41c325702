"""Every export, checked by the framework's own rules: torchtitan 0.2.0's ConfigManager and
DeepSpeed 0.19.8's DeepSpeedConfig where they install (tests/interop/frameworks.py), and
Megatron-LM's parser and validate_args at d98e8a6 as tests/interop/megatron_rules.py states
them (none of its registry packages holds them). Dense tp > 1, FSDP2, MoE, FP8, uneven
pipeline stages and every example run spec; `aihpc search --for` stays inside what the
framework runs, and `aihpc export` prints the estimate of the plan as the framework runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import frameworks
import megatron_rules
import pytest

from aihpc.interop import export_deepspeed, export_megatron, export_torchtitan, import_megatron
from aihpc.interop.deepspeed.writer import deepspeed_refusal
from aihpc.interop.megatron.runs import megatron_refusal
from aihpc.interop.megatron.writer import megatron_as_run
from aihpc.interop.torchtitan.writer import torchtitan_refusal
from aihpc.perf.search.ranking import search
from aihpc.runspec import RunSpec, SpecError, load_runspec, runspec_from_dict

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.toml") if "calibration" not in p.name)


def _spec(model: dict, gpus: int, parallel: dict, training: dict | None = None) -> RunSpec:
    return runspec_from_dict(
        {
            "model": model,
            "cluster": {"gpu": "h100-sxm", "num_gpus": gpus, "gpus_per_node": 8},
            "parallel": parallel,
            "training": training or {},
        }
    )


# The plans of the outside check (each broke validate_args before), and FP8 and MoE
PLANS = {
    "dense tp 8": _spec({"preset": "llama3-70b"}, 256, {"tp": 8, "pp": 4, "vpp": 5,
                        "global_batch_size": 256, "zero_stage": 1}),
    "fsdp2": _spec({"preset": "llama3-8b"}, 64, {"tp": 2, "global_batch_size": 64,
                   "zero_stage": 3}),
    "moe": _spec({"preset": "mixtral-8x7b"}, 64, {"tp": 2, "ep": 8, "global_batch_size": 64,
                 "zero_stage": 1}),
    "fp8": _spec({"preset": "llama3-8b"}, 64, {"tp": 4, "global_batch_size": 64,
                 "zero_stage": 1}, {"precision": "fp8", "fp8_param_gather": True}),
    "uneven pp": _spec({"preset": "llama3-405b"}, 1024, {"tp": 8, "pp": 8, "global_batch_size":
                       512, "zero_stage": 1}),  # 126 layers over 8 stages
    "uneven vpp + mtp": _spec({"preset": "deepseek-v3"}, 1024, {"tp": 1, "pp": 16, "vpp": 2,
                              "ep": 64, "global_batch_size": 1024, "zero_stage": 1}),
    "balanced": _spec({"preset": "deepseek-v3"}, 1024, {"tp": 1, "pp": 16, "ep": 64,
                      "global_batch_size": 1024, "zero_stage": 1},
                      {"pipeline_split": "balanced"}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PLANS))
def test_megatron_rules_accept_each_plan(name: str) -> None:
    spec = PLANS[name]
    script, _ = export_megatron(spec)
    assert megatron_rules.problems(script) == []
    launch = megatron_rules.read_launch(script)
    p = spec.plan()
    if p.tp > 1 and p.zero_stage != 3:
        assert launch.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    if p.zero_stage == 3:
        assert launch.env["CUDA_DEVICE_MAX_CONNECTIONS"] is None  # unset: FSDP2 asserts != 1
    layout = launch.value("--pipeline-model-parallel-layout")
    if spec.model.num_layers % (p.pp * p.vpp) or spec.training.pipeline_split == "balanced":
        stages = megatron_rules.layout_stages(layout)
        assert len(stages) == p.pp * p.vpp
        sizes = [s.count("t") for s in stages]
        if spec.training.pipeline_split == "uneven":  # the busiest chunk as the model prices it
            assert max(sizes) == -(-spec.model.num_layers // (p.pp * p.vpp))
        else:  # balanced: E and L take a layer's slot
            units = [len(s) for s in stages]
            assert max(units) - min(units) <= 1
    else:
        assert layout is None


def test_megatron_rules_catch_each_defect_of_the_old_export() -> None:
    """The rules checker refuses what the outside check found (so a passing export is news)."""
    script, _ = export_megatron(PLANS["fsdp2"])
    assert "unset CUDA_DEVICE_MAX_CONNECTIONS" in script
    broken = {
        "tp without one connection": export_megatron(PLANS["dense tp 8"])[0].replace(
            "export CUDA_DEVICE_MAX_CONNECTIONS=1\n", ""
        ),
        "fsdp2 with the fusion": script.replace("--no-gradient-accumulation-fusion", "--bf16"),
        "removed flag": script.replace("--mock-data", "--moe-use-legacy-grouped-gemm"),
        "float repr": script.replace("--seed 1234", "--seed 12.5"),
    }
    for what, text in broken.items():
        assert megatron_rules.problems(text), what


def test_megatron_export_carries_fp8_recipe_and_moe_without_removed_flags() -> None:
    fp8 = megatron_rules.read_launch(export_megatron(PLANS["fp8"])[0])
    assert (fp8.value("--fp8-format"), fp8.value("--fp8-recipe")) == ("hybrid", "delayed")
    assert fp8.has("--fp8-param-gather")
    moe, dropped = export_megatron(PLANS["moe"])
    assert "--moe-use-legacy-grouped-gemm" not in moe and "--moe-grouped-gemm" in moe
    assert any(d.startswith("training.moe_expert_gemm = 'grouped'") for d in dropped)


def test_megatron_vocab_padded_as_megatron_pads_it() -> None:
    """GPT-3's 50,257 tokens at tp 2: Megatron pads to a multiple of 128 x 2; the export says
    so, the estimate is of the padded model, and the import reads it back padded."""
    spec = _spec({"preset": "gpt3-175b"}, 256, {"tp": 2, "pp": 8, "global_batch_size": 256})
    script, dropped = export_megatron(spec)
    launch = megatron_rules.read_launch(script)
    padded = megatron_rules.padded_vocab(launch)
    assert padded == 50432 and launch.value("--vocab-size") == "50257"
    assert "model.vocab_size = 50257 (Megatron-LM runs 50432)" in dropped
    ran, changes = megatron_as_run(spec)
    assert ran.model.vocab_size == padded
    assert "model.vocab_size = 50257 -> 50432" in changes
    assert import_megatron(script).spec().model.vocab_size == padded
    # where tp divides it, the divisor Megatron is given pads nothing
    llama = megatron_rules.read_launch(export_megatron(PLANS["dense tp 8"])[0])
    assert megatron_rules.padded_vocab(llama) == PLANS["dense tp 8"].model.vocab_size


def test_megatron_min_lr_is_a_short_number() -> None:
    spec = _spec({"preset": "llama3-8b"}, 8, {"tp": 1, "global_batch_size": 8},
                 {"learning_rate": 3e-4, "min_lr_ratio": 0.1})  # fmt: skip
    launch = megatron_rules.read_launch(export_megatron(spec)[0])
    assert launch.value("--min-lr") == f"{3e-4 * 0.1:.12g}" == "3e-05"


def _aihpc_plan_rules(framework: str, spec: RunSpec):
    from aihpc.cli._frameworks import plan_rules

    return plan_rules(framework, spec)


def _searched_best(spec: RunSpec, rules) -> RunSpec | None:
    p = spec.parallel
    free = replace(p, **{k: None for k in ("tp", "pp", "vpp", "cp", "dp", "ep", "etp",
                                           "sequence_parallel", "zero_stage", "recompute",
                                           "micro_batch_size", "moe_a2a_overlap")
                         if hasattr(p, k)})  # fmt: skip
    base = replace(spec, parallel=free)
    result = search(base, top=3, accept=rules(base))
    if not result.plans:  # nothing the framework runs: the search says which field refused
        assert result.refusal() is not None or result.evaluated, spec.path
        return None
    for e in result.plans:
        assert rules(base)(e.plan) is None
    best = result.plans[0].plan
    return replace(
        base, parallel=type(p)(**{k: getattr(best, k) for k in vars(p) if hasattr(best, k)})
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_exports_as_megatron_accepts(path: Path) -> None:
    """Each example exports to a script Megatron's rules accept, or is refused by the same rule
    `aihpc search --for megatron` applies; the best plan that search finds exports cleanly."""
    spec = load_runspec(path)
    try:
        script, _ = export_megatron(spec)
    except SpecError as err:
        try:
            plan = spec.plan()
        except SpecError:
            plan = None  # an incomplete plan: the search completes it
        if plan is not None:
            refusal = megatron_refusal(spec.model, plan, spec.training)
            assert refusal is not None and refusal.field == err.field
    else:
        assert megatron_rules.problems(script) == [], path.name

    def rules(s: RunSpec):
        return lambda plan: megatron_refusal(s.model, plan, s.training)

    if "deepseek" in path.name:  # DualPipe and FP8 dispatch: Megatron runs neither
        with pytest.raises(SpecError, match=r"training\.moe_dispatch_dtype"):
            _aihpc_plan_rules("megatron", spec)
        spec = replace(spec, parallel=replace(spec.parallel, moe_a2a_overlap="none"))
        spec = replace(spec, training=replace(spec.training, moe_dispatch_dtype="bf16"))
    best = _searched_best(spec, rules)
    assert best is not None, path.name  # Megatron runs a plan of every example
    script, _ = export_megatron(best)
    assert megatron_rules.problems(script) == [], path.name


@pytest.mark.skipif(not os.environ.get("AIHPC_MEGATRON_LM"), reason="no Megatron-LM checkout")
@pytest.mark.parametrize("name", sorted(PLANS))
def test_megatron_own_validate_args_accepts(name: str) -> None:  # pragma: no cover
    """With a Megatron-LM checkout (AIHPC_MEGATRON_LM), its own parse_args + validate_args."""
    script, _ = export_megatron(PLANS[name])
    assert megatron_rules.validate_with_checkout(script, os.environ["AIHPC_MEGATRON_LM"]) == ""


def _framework(load):
    try:
        return load()
    except ImportError as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must check exports with the frameworks' own parsers: {err}")
        pytest.skip(f"{err}: python3 tests/interop/frameworks.py install")


def test_torchtitan_config_manager_reads_fp8_export(tmp_path: Path) -> None:
    """torchtitan 0.2 reads FP8 from [quantize.linear.float8] (its converter
    "quantize.linear.float8"); the pre-0.2 [float8] table is refused by its ConfigManager."""
    manager = _framework(frameworks.torchtitan_config_manager)
    parallel = {"tp": 2, "global_batch_size": 64, "zero_stage": 3, "sequence_parallel": True}
    spec = _spec(
        {"preset": "llama3-8b"}, 64, parallel, {"precision": "fp8", "fp8_param_gather": True}
    )
    path = tmp_path / "job.toml"
    path.write_text(export_torchtitan(spec)[0])
    config = manager().parse_args([f"--job.config_file={path}"])
    assert config.model.converters == ["quantize.linear.float8"]
    float8 = config.quantize.linear.float8
    assert float8.enable_fsdp_float8_all_gather and float8.recipe_name == "tensorwise"
    old = tmp_path / "old.toml"
    old.write_text(path.read_text() + "\n[float8]\nenable_fsdp_float8_all_gather = true\n")
    with pytest.raises(BaseException):  # noqa: B017 - tyro exits on an unknown table
        manager().parse_args([f"--job.config_file={old}"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_torchtitan_and_deepspeed(path: Path, tmp_path: Path, monkeypatch) -> None:
    """Each example's best plan for torchtitan and DeepSpeed (as `aihpc search --for` finds
    it), read by their own config classes; a model torchtitan does not train is refused."""
    manager = _framework(frameworks.torchtitan_config_manager)
    ds_config = _framework(frameworks.deepspeed_config)
    spec = load_runspec(path)
    if spec.parallel.moe_a2a_overlap == "dualpipe":
        spec = replace(spec, parallel=replace(spec.parallel, moe_a2a_overlap="none"))
    if spec.model.name.startswith("llama3-"):
        best = _searched_best(spec, lambda s: lambda p: torchtitan_refusal(s.model, p, s.training))
        assert best is not None, path.name
        job = tmp_path / "job.toml"
        job.write_text(export_torchtitan(best)[0])
        config = manager().parse_args([f"--job.config_file={job}"])
        assert config.parallelism.tensor_parallel_degree == best.plan().tp
    else:
        with pytest.raises(SpecError):
            export_torchtitan(spec)
    if spec.model.position_embedding != "rope" or spec.training.precision == "fp8":
        return
    best = _searched_best(spec, lambda s: lambda p: deepspeed_refusal(s.model, p, s.training))
    if best is None:  # data parallel alone does not fit (or divide the batch): refused
        return
    text, _, _ = export_deepspeed(best)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    dp = best.plan().dp
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: dp)
    config = ds_config.DeepSpeedConfig(json.loads(text), mpu=mpu)
    assert config.train_batch_size == best.plan().global_batch_size


def _aihpc(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "aihpc", *args], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip


def test_search_for_a_framework_and_export_estimate(tmp_path: Path) -> None:
    """`aihpc search --for megatron` lists only plans Megatron runs (a ZeRO-2 fixed in the spec
    is refused, naming the field); `aihpc export` prints the estimate of the plan as Megatron
    runs it when it differs (a padded vocabulary)."""
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(
        '[model]\npreset = "gpt3-175b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 256\n'
        "[parallel]\ntp = 2\npp = 8\nglobal_batch_size = 256\n"
    )
    out = _aihpc("export", str(spec_path), "--to", "megatron", "-o", str(tmp_path / "a.sh"))
    assert out.returncode == 0, out.stderr
    assert "estimate as megatron runs it" in out.stderr and "50257 -> 50432" in out.stderr
    zero2 = tmp_path / "zero2.toml"
    zero2.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 16\n'
        "[parallel]\npp = 2\nzero_stage = 2\nglobal_batch_size = 64\n"
    )
    refused = _aihpc("search", str(zero2), "--for", "megatron", "--json")
    assert refused.returncode == 2 and "parallel.zero_stage" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    free = tmp_path / "free.toml"
    free.write_text(zero2.read_text().replace("pp = 2\nzero_stage = 2\n", ""))
    found = _aihpc("search", str(free), "--for", "torchtitan", "--json", "--top", "50")
    assert found.returncode == 0, found.stderr
    plans = json.loads(found.stdout)["plans"]
    assert plans and all(p["plan"]["zero_stage"] != 1 for p in plans)
    everything = json.loads(_aihpc("search", str(free), "--json", "--top", "50").stdout)["plans"]
    assert any(p["plan"]["zero_stage"] == 1 for p in everything)  # the filter did the work


def test_rope_base_travels_to_every_framework() -> None:
    """Llama 3's RoPE base, 500,000: Megatron's --rotary-base (an int), a config.json's
    rope_theta, torchtitan's llama3 flavors; each read back. A base Megatron cannot write is
    refused, naming the field."""
    spec = PLANS["dense tp 8"]
    assert spec.model.rope_theta == 500000
    script, _ = export_megatron(spec)
    assert megatron_rules.read_launch(script).value("--rotary-base") == "500000"
    assert import_megatron(script).spec().model.rope_theta == 500000
    from aihpc.interop import hf_config, import_torchtitan
    from aihpc.interop.hf import hf_model_shape

    assert hf_model_shape(hf_config(spec), None)["rope_theta"] == 500000
    titan = _spec({"preset": "llama3-8b"}, 8, {"tp": 1, "global_batch_size": 8, "zero_stage": 3})
    assert import_torchtitan(export_torchtitan(titan)[0]).spec().model.rope_theta == 500000
    odd = replace(spec, model=replace(spec.model, rope_theta=1e4 + 0.5))
    with pytest.raises(SpecError) as err:
        export_megatron(odd)
    assert err.value.field == "model.rope_theta"


def test_export_estimate_as_the_framework_runs_it() -> None:
    """torchtitan runs TP without overlap and repeats K/V heads: the estimate of the plan as it
    runs it is slower than the run spec's, and the export says so; where the fields it changes
    price the same (DeepSpeed's cp_exchange without cp), there is no line."""
    from aihpc.cli._frameworks import estimate_line
    from aihpc.perf.step.estimate import estimate

    titan = _spec({"preset": "llama3-8b"}, 8, {"tp": 2, "global_batch_size": 64, "zero_stage": 3,
                  "sequence_parallel": True})  # fmt: skip
    line, data = estimate_line("torchtitan", titan)
    assert line is not None and "training.tp_comm_overlap = 'backward' -> 'none'" in line
    assert data["step_time_s"] > estimate(titan).step_time_s
    ds = _spec({"preset": "llama3-8b"}, 8, {"tp": 1, "pp": 1, "cp": 1, "global_batch_size": 64},
               {"cp_exchange": "allgather"})  # fmt: skip
    assert export_deepspeed(ds)[2]  # listed as not carried...
    assert estimate_line("deepspeed", ds) == (None, None)  # ...but priced the same


def test_torchtitan_fp8_export_imports_back_as_fp8() -> None:
    from aihpc.interop import import_torchtitan

    parallel = {"tp": 2, "global_batch_size": 64, "zero_stage": 3, "sequence_parallel": True}
    fp8 = {"precision": "fp8", "fp8_param_gather": True}
    spec = _spec({"preset": "llama3-8b"}, 64, parallel, fp8)
    back = import_torchtitan(export_torchtitan(spec)[0]).spec().training
    assert (back.precision, back.fp8_param_gather) == ("fp8", True)
