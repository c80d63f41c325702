"""Importing the frameworks' own kind of config (fixtures written by us from their documented
options): every field carried, every unpriced field named, and `aihpc estimate` runs on the
result. Where the framework is installed, its own parser accepts what `aihpc export` writes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import frameworks
import megatron_rules
import pytest

from aihpc.interop import (
    export_deepspeed,
    export_megatron,
    export_torchtitan,
    import_deepspeed,
    import_megatron,
    import_torchtitan,
)
from aihpc.interop.hf import hf_config, hf_model_shape
from aihpc.interop.megatron import parse_flags
from aihpc.interop.shell import command_tokens
from aihpc.perf.step.estimate import estimate
from aihpc.runspec import SpecError, load_runspec, runspec_from_dict

DATA = Path(__file__).parent / "data"
T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]


def test_megatron_llama3_70b_script() -> None:
    text = (DATA / "megatron_llama3_70b.sh").read_text()
    imported = import_megatron(text)
    spec = imported.spec()
    # what the script says, read independently of the importer: its arrays and torchrun words
    launcher, words = command_tokens(text, "pretrain_gpt.py")
    flags = parse_flags(words)
    assert launcher[0] == "torchrun" and flags["--num-layers"] == "80"
    m, p, t = spec.model, spec.plan(), spec.training
    assert spec.cluster.num_gpus == 64 * 8 and spec.cluster.gpus_per_node == 8
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads) == (80, 8192, 64, 8)
    assert (m.ffn_hidden_size, m.ffn_activation, m.seq_length) == (28672, "swiglu", 8192)
    assert not m.tied_embeddings and m.position_embedding == "rope"
    assert m.rope_theta == 500000  # --rotary-base, the model's (it was not read)
    # the Llama 3 tokenizer's 128,256 entries, padded by Megatron to a multiple of 128 x tp 8
    assert m.vocab_size == 129024 and m.name == "llama3-70b (modified)"
    assert (p.tp, p.pp, p.cp, p.dp) == (8, 4, 1, 16)
    assert p.vpp == 80 // (4 * 4)  # --num-layers-per-virtual-pipeline-stage 4
    assert p.sequence_parallel and p.zero_stage == 1 and p.recompute == "none"
    assert (p.micro_batch_size, p.global_batch_size) == (1, 512)
    assert (t.precision, t.optimizer, t.learning_rate) == ("bf16", "adamw", 1.5e-4)
    assert t.min_lr_ratio == pytest.approx(0.1) and t.warmup_steps == 2000
    assert (t.adam_beta2, t.weight_decay, t.dropout) == (0.95, 0.1, 0.0)
    assert t.cross_entropy == "fused" and t.grad_reduce_overlap and t.pipeline_split == "even"
    assert t.train_steps == 500000 and t.log_interval == 10
    assert spec.checkpoint.interval_steps == 1000
    # every flag the script sets is either carried or named as not priced
    unpriced = set(imported.unpriced)
    assert unpriced == {
        "--normalization", "--disable-bias-linear", "--overlap-param-gather",
        "--data-path", "--split", "--eval-interval", "--eval-iters", "--save", "--load",
    }  # fmt: skip
    assert unpriced < set(flags)
    assert estimate(spec).fits


def test_torchtitan_llama3_tomls() -> None:
    small = import_torchtitan((DATA / "torchtitan_llama3_8b.toml").read_text(), num_gpus=8)
    spec = small.spec()
    p = spec.plan()
    assert spec.model.name == "llama3-8b" and spec.model.seq_length == 8192
    assert (p.dp, p.zero_stage, p.recompute, p.micro_batch_size, p.global_batch_size) == (
        8, 3, "op", 1, 8,
    )  # fmt: skip
    assert spec.training.fused_kernels and spec.training.cross_entropy == "fused"  # compile on
    assert spec.training.learning_rate == 3e-4 and spec.training.warmup_steps == 200
    assert "optimizer.eps" in small.unpriced and "training.dataset" in small.unpriced
    assert "profiling.enable_profiling" in small.unpriced
    assert estimate(spec).fits

    big = import_torchtitan((DATA / "torchtitan_llama3_70b.toml").read_text())
    spec = big.spec()
    p = spec.plan()
    assert spec.cluster.num_gpus == 64  # the TOML's degrees: shard 8 x tp 8
    assert (p.tp, p.dp, p.sequence_parallel, p.zero_stage, p.recompute) == (8, 8, True, 3, "full")
    assert (p.micro_batch_size, p.global_batch_size) == (8, 64)  # local batch x dp
    assert spec.checkpoint.interval_steps == 500 and spec.checkpoint.async_save
    assert not spec.training.fused_kernels and spec.training.cross_entropy == "eager"
    estimate(spec)


def test_deepspeed_zero3_json_with_hf_model() -> None:
    imported = import_deepspeed(
        (DATA / "deepspeed_zero3.json").read_text(),
        model_text=(DATA / "llama3_8b_config.json").read_text(),
    )
    spec = imported.spec()
    p, t = spec.plan(), spec.training
    assert spec.model.name == "llama3-8b"  # the config.json's shape is the preset's
    assert spec.cluster.num_gpus == 256 // (2 * 4)  # train_batch / (micro x accumulation)
    assert (p.dp, p.zero_stage, p.micro_batch_size, p.global_batch_size) == (32, 3, 2, 256)
    assert p.recompute == "full" and t.grad_reduce_overlap and t.grad_reduce_dtype == "bf16"
    assert (t.learning_rate, t.warmup_steps, t.train_steps, t.min_lr_ratio) == (
        2e-4, 500, 10000, 0.1,
    )  # fmt: skip
    assert t.log_interval == 50 and t.grad_clip == 1.0
    assert "zero_optimization.stage3_prefetch_bucket_size" in imported.unpriced
    assert "wall_clock_breakdown" in imported.unpriced
    assert "optimizer.params.lr" not in imported.unpriced
    estimate(spec)


def test_cli_import_then_estimate(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = tmp_path / "imported.toml"
    run = subprocess.run(
        [sys.executable, "-m", "aihpc", "import", "megatron", str(DATA / "megatron_llama3_70b.sh"),
         "-o", str(out)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "warning: not priced (9 set in the source): --normalization" in run.stderr
    assert load_runspec(out).plan().tp == 8
    est = subprocess.run(
        [sys.executable, "-m", "aihpc", "estimate", str(out), "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert est.returncode == 0 and json.loads(est.stdout)["plan"]["vpp"] == 5
    bad = subprocess.run(
        [sys.executable, "-m", "aihpc", "export", str(out), "--to", "deepspeed"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: parallel.tp = 8: DeepSpeed's engine is data parallel (ZeRO) only: 1"
    ]


# Megatron-LM ships no argument parser on PyPI (megatron-core holds megatron.core only; the
# parser is megatron/training/arguments.py in the repository): the options its parser knows at
# d98e8a6, read out of the parser itself, are data/megatron_d98e8a6_flags.tsv, and
# megatron_rules.py checks the rest of parse_args / validate_args (test_interop_exports.py).
MEGATRON_FLAGS = set(megatron_rules.known_options())
TORCHRUN_FLAGS = {"--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint"}


@pytest.mark.parametrize(
    ("parallel", "training"),
    [
        ({"tp": 8, "pp": 4, "vpp": 5, "global_batch_size": 512, "zero_stage": 1}, {}),
        (
            {"tp": 4, "pp": 1, "cp": 2, "global_batch_size": 512, "zero_stage": 3,
             "recompute": "full", "offload_layers": 0},
            {"precision": "fp8", "fp8_param_gather": True, "grad_reduce_dtype": "bf16",
             "optimizer_dtype": "bf16", "attention": "flash2", "cp_exchange": "allgather",
             "cuda_graphs": "full"},
        ),
    ],
)  # fmt: skip
def test_megatron_export_uses_documented_flags(parallel: dict, training: dict) -> None:
    spec = runspec_from_dict(
        {
            "model": {"preset": "llama3-70b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 1024},
            "parallel": parallel,
            "training": training,
        }
    )
    script, _ = export_megatron(spec)
    launcher, words = command_tokens(script, "pretrain_gpt.py")
    assert set(parse_flags(words)) <= MEGATRON_FLAGS
    assert megatron_rules.problems(script) == []
    assert set(parse_flags(launcher)) <= TORCHRUN_FLAGS
    result = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr  # bash parses it


# Every MoE / MLA option aihpc carries to Megatron-LM, on a DeepSeek-V3-like model.
MOE_EVERY_OPTION = {
    "model": {"preset": "deepseek-v3", "moe_capacity_factor": 1.25,
              "moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5,
              "moe_router_bias_update_rate": 0.001, "moe_aux_loss_coeff": 0.0001},
    "cluster": {"gpu": "h100-sxm", "num_gpus": 256},
    "parallel": {"tp": 2, "pp": 1, "ep": 8, "etp": 1, "global_batch_size": 256,
                 "recompute": "selective", "recompute_modules": ["mla_up_proj", "moe_act"],
                 "moe_a2a_overlap": "1f1b"},
    "training": {"pipeline_split": "even", "moe_dispatcher": "hierarchical",
                 "cuda_graphs": "partial"},
}  # fmt: skip


def test_megatron_moe_export_uses_documented_flags() -> None:
    script, _ = export_megatron(runspec_from_dict(MOE_EVERY_OPTION))
    flags = parse_flags(command_tokens(script, "pretrain_gpt.py")[1])
    assert set(flags) <= MEGATRON_FLAGS
    assert flags["--recompute-modules"] == ["core_attn", "mla_up_proj", "moe_act"]
    assert flags["--moe-token-dispatcher-type"] == "flex"
    assert flags["--cuda-graph-impl"] == "transformer_engine"
    result = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


def test_sliding_window_attention_crosses_megatron_and_hf_configs() -> None:
    # GPT-OSS: 128-token windows (Megatron-Core's window (127, 0)), every 2nd layer full
    spec = runspec_from_dict(
        {
            "model": {"preset": "gpt-oss-120b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 64},
            "parallel": {"ep": 8, "global_batch_size": 64},
        }
    )
    script, _ = export_megatron(spec)
    flags = parse_flags(command_tokens(script, "pretrain_gpt.py")[1])
    assert set(flags) <= MEGATRON_FLAGS
    assert (flags["--window-size"], flags["--window-attn-skip-freq"]) == ("127,0", "2")
    back = import_megatron(script).spec().model
    assert (back.attention_window, back.full_attention_every) == (128, 2)
    with pytest.raises(SpecError, match="--window-size"):
        import_megatron(script.replace("127,0", "127,5"))
    config = {
        "hidden_size": 2880,
        "num_hidden_layers": 6,
        "num_attention_heads": 64,
        "intermediate_size": 2880,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "sliding_window": 128,
    }
    types = ["sliding_attention", "full_attention"] * 3
    shape = hf_model_shape({**config, "layer_types": types}, None)
    assert (shape["attention_window"], shape["full_attention_every"]) == (128, 2)
    assert "full_attention_every" not in hf_model_shape(config, None)  # Mistral: every layer
    gemma2 = hf_model_shape({**config, "model_type": "gemma2"}, None)  # alternates, in code
    assert gemma2["full_attention_every"] == 2
    gemma3 = hf_model_shape({**config, "sliding_window_pattern": 6}, None)
    assert gemma3["full_attention_every"] == 6
    assert "attention_window" not in hf_model_shape({**config, "use_sliding_window": False}, None)
    with pytest.raises(SpecError, match="layer_types"):
        hf_model_shape({**config, "layer_types": ["full_attention", *types[1:]]}, None)
    hf = hf_config(spec)  # the config.json export_deepspeed writes, read back
    assert hf["layer_types"][:2] == types[:2] and len(hf["layer_types"]) == 36
    back_hf = hf_model_shape(hf, None)
    assert (back_hf["attention_window"], back_hf["full_attention_every"]) == (128, 2)


def _framework(load: Callable[[], T]) -> T:
    """A framework's parser from .frameworks/ (or AIHPC_FRAMEWORKS_PATH); skipped when it is
    not installed, except in CI, which installs it (tests/interop/frameworks.py install)."""
    try:
        return load()
    except ImportError as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must check exports with the frameworks' own parsers: {err}")
        pytest.skip(f"{err}: python3 tests/interop/frameworks.py install")


@pytest.mark.parametrize("preset", ["llama3-8b", "llama3-70b"])
def test_torchtitan_config_manager_reads_export(preset: str, tmp_path: Path) -> None:
    manager = _framework(frameworks.torchtitan_config_manager)
    spec = runspec_from_dict(
        {
            "model": {"preset": preset},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 256},
            "parallel": {"tp": 8, "pp": 4, "vpp": 5 if preset == "llama3-70b" else 2,
                         "global_batch_size": 256, "zero_stage": 3, "recompute": "op"},
        }
    )  # fmt: skip
    text, _ = export_torchtitan(spec)
    path = tmp_path / "job.toml"
    path.write_text(text)
    config = manager().parse_args([f"--job.config_file={path}"])
    par = config.parallelism
    p = spec.plan()
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (p.tp, p.pp)
    assert par.data_parallel_shard_degree * par.data_parallel_replicate_degree == p.dp
    assert config.model.flavor == {"llama3-8b": "8B", "llama3-70b": "70B"}[preset]
    assert config.training.seq_len == spec.model.seq_length
    assert config.training.global_batch_size == p.global_batch_size
    assert config.activation_checkpoint.selective_ac_option == "op"
    if preset == "llama3-70b":  # 20 stages of 80 layers: named module lists
        assert len(par.module_fqns_per_model_part) == p.pp * p.vpp


def test_torchtitan_scheduler_runs_the_run_specs_schedule(tmp_path: Path) -> None:
    """torchtitan's own build_lr_schedulers, from the config its ConfigManager reads out of the
    export, follows the run spec's schedule (aihpc.runtime.job.lr_lambda)."""
    manager = _framework(frameworks.torchtitan_config_manager)
    import torch
    from torchtitan.components.lr_scheduler import build_lr_schedulers  # type: ignore

    from aihpc.runtime.job import lr_lambda

    spec = runspec_from_dict(
        {
            "model": {"preset": "llama3-8b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": {"tp": 1, "pp": 1, "global_batch_size": 64, "zero_stage": 3},
            "training": {"train_steps": 60, "warmup_steps": 8, "min_lr_ratio": 0.1},
        }
    )
    path = tmp_path / "job.toml"
    path.write_text(export_torchtitan(spec)[0])
    config = manager().parse_args([f"--job.config_file={path}"])
    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=config.optimizer.lr)
    (scheduler,) = build_lr_schedulers([optimizer], config.lr_scheduler, config.training.steps)
    t, factor = spec.training, lr_lambda(spec.training)
    for i in range(t.train_steps + 1):  # past its steps torchtitan's cosine rises again
        # torchtitan holds the peak for one step after warmup (its stable_steps = 1), so its
        # decay runs one step behind aihpc's
        want = factor(i) if i < t.warmup_steps else factor(i - 1)
        assert scheduler.get_last_lr()[0] == pytest.approx(t.learning_rate * want, rel=1e-9), i
        optimizer.step()  # no gradient: changes nothing, keeps torch's step order
        scheduler.step()


def test_deepspeed_config_class_reads_export(monkeypatch: pytest.MonkeyPatch) -> None:
    ds_config = _framework(frameworks.deepspeed_config)
    spec = runspec_from_dict(
        {
            "model": {"preset": "llama3-8b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": {"tp": 1, "pp": 1, "cp": 1, "global_batch_size": 64, "zero_stage": 3,
                         "micro_batch_size": 2, "dp_shard": 4, "recompute": "full"},
        }
    )  # fmt: skip
    text, _, _ = export_deepspeed(spec)
    # DeepSpeedConfig takes the world size from the process group (none here) or an mpu
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: 8)
    config = ds_config.DeepSpeedConfig(json.loads(text), mpu=mpu)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (64, 2)
    assert config.gradient_accumulation_steps == 4 and config.zero_optimization_stage == 3
    assert config.zero_config.zero_hpz_partition_size == 4 and config.zero_config.overlap_comm
    assert config.optimizer_name == "adamw" and config.scheduler_name == "WarmupCosineLR"
    assert re.search("float32", str(config.communication_data_type))


def test_deepspeed_scheduler_runs_the_run_specs_schedule() -> None:
    """DeepSpeed's own WarmupCosineLR, built from the exported params as its engine builds it,
    follows the run spec's schedule (aihpc.runtime.job.lr_lambda): linear warmup, cosine decay
    to min_lr_ratio; a warmup DeepSpeed cannot run is refused naming the field."""
    _framework(frameworks.deepspeed_config)
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR  # type: ignore[import-not-found]

    from aihpc.runtime.job import lr_lambda

    spec = runspec_from_dict(
        {
            "model": {"preset": "llama3-8b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": {"tp": 1, "pp": 1, "cp": 1, "global_batch_size": 64},
            "training": {"train_steps": 60, "warmup_steps": 8, "min_lr_ratio": 0.1},
        }
    )
    config = json.loads(export_deepspeed(spec)[0])
    opt = config["optimizer"]
    assert opt["type"] == "AdamW"
    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **opt["params"])
    scheduler = WarmupCosineLR(optimizer, **config["scheduler"]["params"])
    t, factor = spec.training, lr_lambda(spec.training)
    for i in range(t.train_steps + 5):
        scheduler.step(i)
        # DeepSpeed's linear warmup counts from 0 (i / warmup at iteration i), aihpc's from 1
        want = factor(i - 1) if i < t.warmup_steps else factor(i)
        assert scheduler.get_last_lr()[0] == pytest.approx(t.learning_rate * want, rel=1e-9), i
    no_warmup = replace(spec, training=replace(spec.training, warmup_steps=0))
    with pytest.raises(SpecError) as err:
        export_deepspeed(no_warmup)
    assert err.value.field == "training.warmup_steps"
    constant = replace(spec, training=replace(spec.training, warmup_steps=0, min_lr_ratio=1.0))
    text, _, dropped = export_deepspeed(constant)
    assert "scheduler" not in json.loads(text)
    assert any(d.startswith("training.train_steps") for d in dropped)  # 60, not the default
