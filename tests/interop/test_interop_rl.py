"""verl's config (YAML or a script of Hydra overrides) and slime's launch script → [rl]."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import frameworks  # tests/interop/frameworks.py: verl's shipped configs
import pytest
import yaml

from aihpc.interop import verl as verl_importer
from aihpc.interop import verl_config
from aihpc.interop.slime import import_slime
from aihpc.interop.verl import import_verl
from aihpc.perf.rl import estimate_rl
from aihpc.runspec import SpecError

DATA = Path(__file__).parent / "data" / "rl"


def test_verl_script_overrides_are_applied():
    imported = import_verl((DATA / "verl_grpo_qwen3_30b.sh").read_text())
    t = imported.tables
    assert t["rl"]["algorithm"] == "grpo"
    assert t["rl"]["prompts_per_step"] == 1024 and t["rl"]["samples_per_prompt"] == 5
    assert t["rl"]["rollout"]["tp"] == 2
    assert t["parallel"]["global_batch_size"] == 256 * 5
    assert t["cluster"]["num_gpus"] == 64
    assert estimate_rl(imported.spec()).step_time_s > 0


def test_verl_yaml_is_resolved_and_ppo_has_a_critic():
    imported = import_verl((DATA / "verl_ppo.yaml").read_text(), response_len=900)
    rl = imported.tables["rl"]
    assert rl["algorithm"] == "ppo" and rl["ppo_epochs"] == 2
    assert rl["rollout"]["gpu_memory_utilization"] == 0.4  # ${critic.mem} resolved
    est = estimate_rl(imported.spec())
    assert est.phases_s["critic_update"] > 0


def test_verl_unknown_model_is_one_line():
    with pytest.raises(SpecError) as err:
        import_verl("python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=x/y")
    assert err.value.field == "--model"


def test_slime_script_reads_megatron_and_slime_flags():
    imported = import_slime(
        (DATA / "slime_qwen3_30b_colocated.sh").read_text(), model="qwen3-30b-a3b"
    )
    t = imported.tables
    assert t["rl"]["placement"] == "colocated" and t["rl"]["rollout"]["tp"] == 8
    assert t["parallel"]["tp"] == 4 and t["parallel"]["ep"] == 8
    assert any("not followed" in n for n in imported.notes)  # the sourced model file
    assert "max_num_seqs" not in t["rl"]["rollout"]  # SGLang's own default: what memory holds
    assert t["rl"]["offload"] == "slime"  # --colocate: slime's own moves (perf/rl/switch.py)
    assert estimate_rl(imported.spec()).step_time_s > 0
    capped = (
        (DATA / "slime_qwen3_30b_colocated.sh")
        .read_text()
        .replace(
            "--sglang-mem-fraction-static 0.7",
            "--sglang-mem-fraction-static 0.7 --sglang-max-running-requests 64",
        )
    )
    rollout = import_slime(capped, model="qwen3-30b-a3b").spec().rl.rollout
    assert rollout.max_num_seqs == 64


def test_slime_async_disaggregated():
    text = (
        "python3 train_async.py --actor-num-nodes 1 --actor-num-gpus-per-node 8 "
        "--rollout-num-gpus 8 --rollout-batch-size 64 --n-samples-per-prompt 8 "
        "--rollout-max-response-len 4096 --global-batch-size 512 --rollout-num-gpus-per-engine 2"
    )
    t = import_slime(text, model="qwen3-30b-a3b").tables
    assert t["rl"]["staleness"] == 1 and t["rl"]["rollout_gpus"] == 8
    assert t["cluster"]["num_gpus"] == 16


def test_cli_import_verl_json_and_bad_framework(tmp_path):
    env_cmd = [sys.executable, "-m", "aihpc", "import", "verl"]
    out = subprocess.run(
        [*env_cmd, str(DATA / "verl_grpo_qwen3_30b.sh"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["runspec"]["rl"]["samples_per_prompt"] == 5
    bad = subprocess.run(
        [sys.executable, "-m", "aihpc", "import", "openrlhf", str(DATA / "verl_ppo.yaml")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "verl" in bad.stderr


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("data:\n  train_batch_size: ${oc.env:HOME}\n", "SOURCE"),  # no environment read
        ("- a\n- b\n", "SOURCE"),
        ("data:\n  train_batch_size: ${nope.nope}\n", "SOURCE"),
        ("data: [unclosed\n", "SOURCE"),
        ("data:\n  train_batch_size: abc\n", "data.train_batch_size"),
        ("data:\n  train_batch_size: 0\n", "data.train_batch_size"),
        ("algorithm:\n  adv_estimator: dpo\n", "algorithm.adv_estimator"),
        (
            "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.n=x\n",
            "actor_rollout_ref.rollout.n",
        ),
        ("python3 train.py --lr 1\n", "SOURCE"),
    ],
)
def test_verl_bad_configs_are_one_line(text, field):
    with pytest.raises(SpecError) as err:
        import_verl(text, model="llama3-8b", response_len=100).spec()
    assert err.value.field == field
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "model", "field"),
    [
        ("python3 train.py --rollout-batch-size 8", "llama3-8b", "--rollout-max-response-len"),
        ("python3 train.py --rollout-max-response-len 8", None, "--model"),
        ("python3 pretrain_gpt.py --tensor-model-parallel-size 2", "llama3-8b", "SOURCE"),
        (
            "python3 train.py --rollout-batch-size x --rollout-max-response-len 8",
            "llama3-8b",
            "--rollout-batch-size",
        ),
    ],
)
def test_slime_bad_scripts_are_one_line(text, model, field):
    with pytest.raises(SpecError) as err:
        import_slime(text, model=model).spec()
    assert err.value.field == field


def test_verl_megatron_config_name_reads_the_megatron_layout():
    imported = import_verl(
        (DATA / "verl_megatron_dsv3.sh").read_text(), model="deepseek-v3", response_len=1500
    )
    p = imported.tables["parallel"]
    assert (p["pp"], p["ep"], p["recompute"]) == (16, 16, "full")
    assert "zero_stage" not in p  # not FSDP
    assert imported.tables["cluster"]["num_gpus"] == 256
    assert estimate_rl(imported.spec()).phases_s["update"] > 0


def test_a_comment_inside_an_array_is_no_flag():
    """slime's scripts comment flags out inside their arrays (# --micro-batch-size 1)."""
    text = (
        "PERF=(\n  --tensor-model-parallel-size 2\n  # --micro-batch-size 1\n  #--lr 3\n)\n"
        "python3 train.py ${PERF[@]} --rollout-batch-size 8 --n-samples-per-prompt 2 "
        "--rollout-max-response-len 64 --global-batch-size 16 --actor-num-gpus-per-node 2 "
        "--colocate\n"
    )
    imported = import_slime(text, model="tiny-llama")
    assert imported.tables["parallel"]["tp"] == 2
    assert "--micro-batch-size" not in imported.unpriced and "--lr" not in imported.unpriced


def test_verl_example_scripts_name_whose_offload_moves_the_actor():
    """verl's own example scripts (copied unchanged from volcengine/verl at b178a3c): the Megatron
    one sets param/optimizer/grad offload through a shell variable (``offload=True``), the FSDP
    one sets the actor's fsdp_config offloads; a script that sets neither keeps verl's defaults
    (no offload: the state stays on the GPUs)."""
    cases = {
        "verl_qwen2_7b_megatron_offload.sh": "verl-megatron",
        "verl_qwen2_14b_fsdp_offload.sh": "verl-fsdp",
        "verl_grpo_qwen3_30b.sh": "none",
    }
    for name, offload in cases.items():
        imported = import_verl((DATA / name).read_text(), model="llama3-8b", response_len=500)
        assert imported.tables["rl"]["offload"] == offload, name
        est = estimate_rl(imported.spec())
        assert est.rl.offload == offload
        moved = est.switch_by_timer.get("update_actor", 0.0)
        assert (moved > 0) == (offload != "none"), name
    megatron = import_verl(
        (DATA / "verl_qwen2_7b_megatron_offload.sh").read_text(), model="llama3-8b"
    )
    assert (megatron.tables["parallel"]["tp"], megatron.tables["parallel"]["pp"]) == (2, 2)


def test_verl_fsdp2_and_a_single_offload_flag():
    base = (DATA / "verl_grpo_qwen3_30b.sh").read_text().replace(" $@", "")
    text = base.rstrip() + (
        " \\\n    actor_rollout_ref.actor.strategy=fsdp2"
        " \\\n    actor_rollout_ref.actor.fsdp_config.param_offload=True\n"
    )
    imported = import_verl(text, response_len=500)
    assert imported.tables["rl"]["offload"] == "verl-fsdp2"
    (note,) = [n for n in imported.notes if "param_offload without optimizer_offload" in n]
    assert "upper bound" in note
    bad = base.rstrip() + " \\\n    actor_rollout_ref.actor.fsdp_config.param_offload=maybe\n"
    with pytest.raises(SpecError) as err:
        import_verl(bad, response_len=500)
    assert err.value.field == "actor_rollout_ref.actor.fsdp_config.param_offload"


def test_verl_critic_free_estimators_price_as_their_family_and_remax_generates_a_baseline():
    """verl's other advantage estimators (core_algos.AdvantageEstimator) cost the phases of their
    family, named in a note; ReMax also generates one greedy response per prompt (its gen_max),
    a second rollout of the step's prompts, on the rollout side of the step."""
    base = (DATA / "verl_grpo_qwen3_30b.sh").read_text().replace(" $@", "").rstrip()

    def imported(estimator: str, n: int = 5):
        text = base.replace("adv_estimator=grpo", f"adv_estimator={estimator}")
        return import_verl(text.replace("rollout.n=5", f"rollout.n={n}"), response_len=500)

    for estimator, family in (("gpg", "grpo"), ("rloo_vectorized", "rloo")):
        got = imported(estimator)
        assert got.tables["rl"]["algorithm"] == family
        assert any(f"{estimator} priced as {family}" in n for n in got.notes)
    with pytest.raises(SpecError) as err:  # a group baseline needs a group
        imported("grpo_passk", n=1).spec()
    assert err.value.field == "rl.samples_per_prompt"
    one = imported("reinforce_plus_plus", n=1)  # a batch-wide baseline: one sample is enough
    assert one.tables["rl"]["algorithm"] == "reinforce"
    assert estimate_rl(one.spec()).phases_s["baseline_rollout"] == 0.0
    grpo = estimate_rl(imported("grpo").spec())
    remax = estimate_rl(imported("remax").spec())
    greedy = remax.phases_s["baseline_rollout"]
    # 1,024 greedy responses of the same lengths as 5,120 sampled: no longer than the rollout,
    # no shorter than its longest response alone
    assert 0 < greedy < remax.phases_s["rollout"]
    assert remax.phases_s["rollout"] == pytest.approx(grpo.phases_s["rollout"])
    assert remax.step_time_s == pytest.approx(grpo.step_time_s + greedy)
    with pytest.raises(SpecError) as err:
        imported("dpo")
    assert err.value.field == "algorithm.adv_estimator"


def test_verl_gspo_script_with_a_backend_switch_and_scheduler_sized_cluster():
    """verl's run_qwen30b_gspo.sh, unchanged: the backend is chosen by a bash branch (megatron),
    the config name by a variable, lengths by $((...)), and the GPU counts come from the
    scheduler's environment, unset here: the import names the options that stand in."""
    text = (DATA / "verl_qwen3_30b_gspo_megatron.sh").read_text()
    with pytest.raises(SpecError) as err:
        import_verl(text, response_len=1000)
    assert err.value.field == "trainer.n_gpus_per_node" and "--gpus-per-node" in err.value.allowed
    imported = import_verl(text, response_len=1000, num_gpus=32, gpus_per_node=8)
    t = imported.tables
    assert t["model"]["preset"] == "qwen3-30b-a3b"  # Qwen3-30B-A3B-Base: the same shape
    assert any("Qwen3-30B-A3B-Base priced as preset qwen3-30b-a3b" in n for n in imported.notes)
    assert (t["parallel"]["tp"], t["parallel"]["ep"], t["parallel"]["recompute"]) == (2, 8, "full")
    assert t["rl"]["max_response_len"] == 8192 and t["rl"]["prompt_len"] == 2048
    assert (t["rl"]["offload"], t["rl"]["kl"]) == ("verl-megatron", False)
    assert t["cluster"]["num_gpus"] == 32
    assert estimate_rl(imported.spec()).step_time_s > 0


def test_cli_gpu_counts_reach_verl_and_are_refused_for_slime():
    cmd = [sys.executable, "-m", "aihpc", "import"]
    gspo = [*cmd, "verl", str(DATA / "verl_qwen3_30b_gspo_megatron.sh"), "--response-len", "1000"]
    out = subprocess.run(
        [*gspo, "--num-gpus", "16", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "--gpus-per-node" in out.stderr  # the per-node count is unset
    out = subprocess.run(
        [*gspo, "--num-gpus", "16", "--gpus-per-node", "8", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["runspec"]["cluster"]["num_gpus"] == 16
    slime = str(DATA / "slime_qwen3_30b_colocated.sh")
    out = subprocess.run(
        [*cmd, "slime", slime, "--model", "qwen3-30b-a3b", "--num-gpus", "16"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--num-gpus" in out.stderr


def _verl_package() -> Path:
    """verl 0.9.1's package folder (tests/interop/frameworks.py installs it); skipped when it is
    missing, except in CI, which installs it."""
    try:
        return frameworks.verl_package()
    except ImportError as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must check the verl import against verl's own configs: {err}")
        pytest.skip(f"{err}: python3 tests/interop/frameworks.py install")


def _leaves(table: dict, prefix: str = ""):
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _at(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"verl 0.9.1 has no {dotted}"
        node = node[part]
    return node


def test_the_verl_defaults_assumed_are_verls_shipped_ones():
    """Every key `aihpc import verl` reads, at the default it assumes, is in verl 0.9.1's own
    trainer config (the Megatron one for the actor's megatron.* keys) with that value: a key
    verl renamed or a default it changed fails here."""
    config_dir = _verl_package() / "trainer" / "config"
    fsdp = yaml.safe_load((config_dir / "_generated_ppo_trainer.yaml").read_text())
    megatron = yaml.safe_load((config_dir / "_generated_ppo_megatron_trainer.yaml").read_text())
    checked = 0
    for dotted, assumed in _leaves(verl_config.DEFAULTS):
        if dotted == "actor_rollout_ref.model.path":  # no model is assumed: --model names it
            continue
        shipped = _at(megatron if ".megatron." in dotted else fsdp, dotted)
        if assumed is False and shipped is None:  # reward_model.enable: null, i.e. off
            shipped = False
        assert shipped == assumed, f"{dotted}: verl 0.9.1 ships {shipped!r}, assumed {assumed!r}"
        checked += 1
    assert checked >= 20


def test_verls_shipped_configs_import_as_its_bare_command():
    """verl's own generated configs, imported as YAML, give the run spec its bare `main_ppo`
    command gives (the FSDP and the Megatron trainer) once the micro-batch is named; without
    one both are refused naming the key, as verl's own ActorConfig refuses them (no dynamic
    batching and no ppo_micro_batch_size_per_gpu)."""
    config_dir = _verl_package() / "trainer" / "config"
    command = "python3 -m verl.trainer.main_ppo"
    mbs = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    for name, extra in (
        ("_generated_ppo_trainer.yaml", ""),
        ("_generated_ppo_megatron_trainer.yaml", " --config-name ppo_megatron_trainer"),
    ):
        text = (config_dir / name).read_text()
        for source in (text, command + extra):
            with pytest.raises(SpecError) as err:
                import_verl(source, model="llama3-8b", response_len=100)
            assert err.value.field == mbs
        config = yaml.safe_load(text)
        config["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] = 2
        shipped = import_verl(yaml.safe_dump(config), model="llama3-8b", response_len=100)
        bare = import_verl(f"{command}{extra} {mbs}=2", model="llama3-8b", response_len=100)
        assert shipped.spec() == bare.spec(), name
        assert shipped.spec().rl.batching == "unpadded"  # verl's fixed micro-batches
        assert shipped.spec().plan().micro_batch_size == 2
        assert estimate_rl(shipped.spec()).step_time_s > 0


def test_every_verl_advantage_estimator_is_priced():
    """verl 0.9.1's AdvantageEstimator (core_algos.py, read with ast: importing it needs torch
    and verl's dependencies) names nothing `aihpc import verl` refuses."""
    source = (_verl_package() / "trainer" / "ppo" / "core_algos.py").read_text()
    (enum,) = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and node.name == "AdvantageEstimator"
    ]
    names = {
        stmt.value.value
        for stmt in enum.body
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
    }
    assert len(names) >= 10
    assert names <= set(verl_importer._ALGORITHMS), names - set(verl_importer._ALGORITHMS)


RL_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "rl"


def _small_rl_spec(parallel: dict, **rl):
    """GRPO for Llama 3 8B on 16 H100, 64 prompts x 8 samples, rollout engines of tp 2; the
    ``[parallel]`` given, ``[rl]`` fields replaced by ``rl``."""
    from aihpc.runspec import runspec_from_dict

    table = {
        "prompts_per_step": 64,
        "samples_per_prompt": 8,
        "prompt_len": 200,
        "response_len": 1000,
        "max_response_len": 2000,
        "rollout": {"tp": 2},
        **rl,
    }
    return runspec_from_dict(
        {
            "model": {"preset": "llama3-8b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 16},
            "parallel": parallel,
            "rl": table,
        }
    )


def _export_cases():
    """The colocated RL examples; an FSDP layout (ZeRO-3 over data parallel, context parallel as
    Ulysses) of Llama 3 8B; a Megatron layout with pipeline stages and full recompute."""
    from aihpc.runspec import load_runspec

    yield load_runspec(RL_EXAMPLES / "grpo_qwen3_30b_a3b_64h100.toml")
    yield load_runspec(RL_EXAMPLES / "grpo_qwen3_30b_a3b_64h100_no_offload.toml")
    yield _small_rl_spec(
        {"zero_stage": 3, "cp": 2, "global_batch_size": 128},
        algorithm="reinforce",
        offload="verl-fsdp",
    )
    yield _small_rl_spec(
        {"tp": 2, "pp": 2, "recompute": "full", "global_batch_size": 128}, kl=False
    )
    # PPO: its critic on the actor's layout (FSDP with Ulysses; Megatron with fixed micro-batches)
    yield _small_rl_spec(
        {"zero_stage": 3, "cp": 2, "global_batch_size": 128}, algorithm="ppo", offload="verl-fsdp"
    )
    yield _small_rl_spec(
        {"tp": 2, "global_batch_size": 128, "micro_batch_size": 2},
        algorithm="ppo",
        batching="unpadded",
    )


def test_verl_export_is_accepted_by_verls_own_config_and_imports_back():
    """`aihpc export --to verl` on colocated RL plans: bash parses the script; every override
    is a key of verl 0.9.1's shipped trainer config (merged as Hydra merges them, the config in
    struct mode, so an unknown key fails); and `aihpc import verl` reads the script back to the
    plan as verl runs it, priced the same."""
    from dataclasses import replace

    from omegaconf import OmegaConf

    from aihpc.interop.bash import read_script
    from aihpc.interop.verl_export import export_verl, verl_as_run

    config_dir = _verl_package() / "trainer" / "config"
    for spec in _export_cases():
        text, _ = export_verl(spec, "case")
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
        (command,) = read_script(text).commands
        megatron = "--config-name" in command.words
        name = "_generated_ppo_megatron_trainer.yaml" if megatron else "_generated_ppo_trainer.yaml"
        shipped = OmegaConf.load(config_dir / name)
        OmegaConf.set_struct(shipped, True)
        overrides = [w for w in command.words if "=" in w and not w.startswith("-")]
        merged = OmegaConf.merge(shipped, OmegaConf.from_dotlist(overrides))
        assert merged.actor_rollout_ref.rollout.n == spec.rl.samples_per_prompt
        assert merged.actor_rollout_ref.rollout.tensor_model_parallel_size == spec.rl.rollout.tp
        assert merged.trainer.nnodes * merged.trainer.n_gpus_per_node == spec.cluster.num_gpus
        ran, _ = verl_as_run(spec)
        again = import_verl(text, model=spec.model.name).spec()
        again = replace(again, rl=replace(again.rl, response_len=ran.rl.response_len))
        assert again.plan() == ran.plan()
        assert (again.rl.offload, again.rl.algorithm) == (ran.rl.offload, ran.rl.algorithm)
        assert estimate_rl(again).step_time_s == pytest.approx(estimate_rl(ran).step_time_s)


@pytest.mark.parametrize(
    ("rl", "field"),
    [
        ({"placement": "disaggregated", "rollout_gpus": 8}, "rl.placement"),
        ({"reward": "model", "reward_model": "llama3-8b"}, "rl.reward"),
        ({"reference": "llama3-70b"}, "rl.reference"),
        ({"samples_per_prompt": 3}, "parallel.global_batch_size"),
        ({"rollout": {"tp": 2, "ep": 2}}, "rl.rollout.ep"),
        ({"rollout": {"tp": 2, "precision": "fp8"}}, "rl.rollout.precision"),
    ],
)
def test_what_verls_main_ppo_cannot_run_is_refused_naming_the_field(rl, field):
    from aihpc.interop.verl_export import export_verl

    gbs = 64 if field == "parallel.global_batch_size" else 128
    spec = _small_rl_spec({"global_batch_size": gbs}, **rl)
    with pytest.raises(SpecError) as err:
        export_verl(spec)
    assert err.value.field == field


def test_cli_export_to_verl_names_the_run_as_verl_runs_it(tmp_path):
    example = str(RL_EXAMPLES / "grpo_qwen3_30b_a3b_64h100.toml")
    out = tmp_path / "run.sh"
    cmd = [sys.executable, "-m", "aihpc", "export", example, "--to", "verl"]
    done = subprocess.run([*cmd, "-o", str(out), "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["config"] == out.read_text() and report["framework"] == "verl"
    assert report["as_run"]["changes"] == ["rl.offload = 'nemo-rl' -> 'verl-megatron'"]
    assert report["as_run"]["step_time_s"] > report["as_run"]["runspec_step_time_s"]
    bad = subprocess.run(
        [sys.executable, "-m", "aihpc", "export", "examples/llama3-70b.toml", "--to", "verl"],
        capture_output=True,
        text=True,
        cwd=RL_EXAMPLES.parents[1],
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "[rl]" in bad.stderr


def test_a_config_json_names_a_model_no_preset_has():
    """Most of verl's examples train Qwen2 / Qwen2.5 checkpoints, most of which have no preset:
    --model takes the checkpoint's Hugging Face config.json instead (verl and slime)."""
    path = DATA.parent / "qwen2.5_7b_instruct_config.json"
    config = json.loads(path.read_text())
    script = (DATA / "verl_qwen2_7b_megatron_offload.sh").read_text()
    imported = import_verl(script, response_len=500, model_config=config)
    model = imported.tables["model"]
    # this config's shape is the qwen2.5-7b preset's, so the import names the preset
    assert model["preset"] == "qwen2.5-7b"
    shape = imported.spec().model
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (28, 3584, 4)
    assert model["seq_length"] == 1024 + 1024  # the script's prompt and response caps
    assert estimate_rl(imported.spec()).step_time_s > 0
    slime = import_slime((DATA / "slime_qwen3_30b_colocated.sh").read_text(), model_config=config)
    assert slime.spec().model.hidden_size == 3584
    cmd = [
        sys.executable,
        "-m",
        "aihpc",
        "import",
        "verl",
        str(DATA / "verl_qwen2_7b_megatron_offload.sh"),
    ]
    done = subprocess.run(
        [*cmd, "--model", str(path), "--response-len", "500", "--json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["runspec"]["model"]["preset"] == "qwen2.5-7b"


@pytest.mark.parametrize("zero_stage", [3, 1])
@pytest.mark.parametrize(
    "offload", ["nemo-rl", "verl-megatron", "verl-fsdp", "verl-fsdp2", "slime", "none"]
)
def test_every_offload_exports_as_the_workers_of_its_plan_move_it(zero_stage, offload):
    """The export writes the offload flags of the worker that runs the plan (FSDP for ZeRO-3
    data parallel, Megatron otherwise; FSDP2 where the spec names its moves) and the import
    reads back what verl_as_run says verl runs."""
    from aihpc.interop.verl_export import export_verl, verl_as_run

    spec = _small_rl_spec({"zero_stage": zero_stage, "global_batch_size": 128}, offload=offload)
    text, _ = export_verl(spec)
    ran, changes = verl_as_run(spec)
    back = import_verl(text, model="llama3-8b", response_len=1000).spec()
    assert back.rl.offload == ran.rl.offload
    assert (ran.rl.offload == offload) == (not any("rl.offload" in c for c in changes))


def test_the_qwen25_7b_preset_is_its_published_config():
    """The ``qwen2.5-7b`` preset (verl's Qwen2.5-7B rows) has the shape of Qwen2.5-7B-Instruct's
    published config.json, read by the Hugging Face importer."""
    from aihpc.interop._common import model_fields
    from aihpc.interop.hf.reader import hf_model_shape
    from aihpc.runspec.model import model_from_table

    config = json.loads((DATA.parent / "qwen2.5_7b_instruct_config.json").read_text())
    theirs = model_fields(model_from_table({**hf_model_shape(config, None), "name": "x"}))
    ours = model_fields(model_from_table({"preset": "qwen2.5-7b"}))
    # every field of the shape the same; the context length is the checkpoint's, not a shape
    assert {**theirs, "seq_length": 0} == {**ours, "seq_length": 0}


def test_verl_micro_batching_sets_the_batching_and_its_size():
    """use_dynamic_bsz packs up to ppo_max_token_len_per_gpu (times the Ulysses degree) tokens:
    bins of micro_batch_size x (prompt + response caps) that divide a rank's share of the
    optimizer step; without it, ppo_micro_batch_size_per_gpu sequences, or the older global
    ppo_micro_batch_size over the data-parallel ranks."""
    base = (
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=meta-llama/llama3-8b "
        "data.max_prompt_length=1024 data.max_response_length=3072 "
        "actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=64 "
        "trainer.nnodes=2 trainer.n_gpus_per_node=8 "
    )
    actor = "actor_rollout_ref.actor."
    dynamic = import_verl(
        base + f"{actor}use_dynamic_bsz=True {actor}ppo_max_token_len_per_gpu=16384 "
        f"{actor}ulysses_sequence_parallel_size=2",
        response_len=900,
    ).spec()
    # 16384 x 2 tokens hold 8 sequences of 4096; a rank's share is 256 / 8 = 32 samples
    assert dynamic.rl.batching == "packed" and dynamic.plan().micro_batch_size == 8
    fixed = import_verl(base + f"{actor}ppo_micro_batch_size_per_gpu=4", response_len=900)
    assert fixed.spec().rl.batching == "unpadded"
    assert fixed.spec().plan().micro_batch_size == 4
    older = import_verl(base + f"{actor}ppo_micro_batch_size=64", response_len=900).spec()
    assert older.rl.batching == "unpadded" and older.plan().micro_batch_size == 64 // 16
    with pytest.raises(SpecError) as err:  # both set: verl's ActorConfig refuses it
        import_verl(
            base + f"{actor}ppo_micro_batch_size=64 {actor}ppo_micro_batch_size_per_gpu=4",
            response_len=900,
        )
    assert err.value.field == actor + "ppo_micro_batch_size"
    # the same layout packed: fewer, fuller micro-batches, a shorter update
    packed = import_verl(
        base + f"{actor}use_dynamic_bsz=True {actor}ppo_max_token_len_per_gpu=16384",
        response_len=900,
    ).spec()
    assert packed.plan().micro_batch_size == 4
    slower = estimate_rl(fixed.spec()).phases_s["update"]
    assert slower > estimate_rl(packed).phases_s["update"] > 0


def test_slime_micro_batching_from_its_own_script():
    """slime's scripts/run-qwen3-4B.sh (THUDM/slime 624b824, copied with its checkpoint folders
    under ${CKPT_DIR} in place of a machine's absolute ones) packs with
    --use-dynamic-batch-size --max-tokens-per-gpu 9216: packed bins of one prompt-and-response
    cap each (9216 // (512 + 8192)); without the flag a micro-batch is --micro-batch-size
    sequences (slime's default 1), packed without padding."""
    text = (DATA / "slime_run-qwen3-4B.sh").read_text()
    imported = import_slime(text, model="llama3-8b", response_len=3000)  # a stand-in shape
    spec = imported.spec()
    assert spec.rl.batching == "packed" and spec.plan().micro_batch_size == 1
    static = text.replace("--use-dynamic-batch-size", "--micro-batch-size 2")
    fixed = import_slime(static, model="llama3-8b", response_len=3000).spec()
    assert fixed.rl.batching == "unpadded" and fixed.plan().micro_batch_size == 2
    assert estimate_rl(fixed).phases_s["update"] > 0


def test_ppo_exports_its_critic_as_verl_configures_it():
    """PPO's critic goes to verl's ``critic`` group on the actor's layout, offload and
    micro-batches (merged into verl 0.9.1's shipped config in struct mode); its checkpoint is
    CRITIC_PATH, the actor's by default, or required where rl.critic names another preset."""
    from omegaconf import OmegaConf

    from aihpc.interop.bash import read_script
    from aihpc.interop.verl_export import export_verl

    config_dir = _verl_package() / "trainer" / "config"
    fsdp = _small_rl_spec({"zero_stage": 3, "cp": 2, "global_batch_size": 128}, algorithm="ppo")
    megatron = _small_rl_spec(
        {"tp": 2, "global_batch_size": 128, "micro_batch_size": 2},
        algorithm="ppo",
        batching="unpadded",
        critic="llama3-70b",
    )
    for spec, name in (
        (fsdp, "_generated_ppo_trainer.yaml"),
        (megatron, "_generated_ppo_megatron_trainer.yaml"),
    ):
        text, notes = export_verl(spec, "case")
        (command,) = read_script(text).commands
        shipped = OmegaConf.load(config_dir / name)
        OmegaConf.set_struct(shipped, True)
        overrides = [w for w in command.words if "=" in w and not w.startswith("-")]
        c = OmegaConf.merge(shipped, OmegaConf.from_dotlist(overrides)).critic
        assert "algorithm.adv_estimator=gae" in overrides
        if spec is fsdp:
            assert c.strategy == "fsdp" and c.ulysses_sequence_parallel_size == 2
            assert c.use_dynamic_bsz is True
            assert ': "${CRITIC_PATH:=$MODEL_PATH}"' in text
        else:
            assert c.megatron.tensor_model_parallel_size == 2
            assert (c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu) == (False, 2)
            assert "CRITIC_PATH:?set CRITIC_PATH to the checkpoint of llama3-70b" in text
        assert any("critic" in n for n in notes)


def test_verl_ppo_reads_its_critics_checkpoint():
    base = (
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=gae "
        "actor_rollout_ref.model.path=meta-llama/llama3-8b actor_rollout_ref.rollout.n=2 "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
    )
    other = import_verl(base + "critic.model.path=/ckpt/llama3-70b", response_len=200)
    assert other.tables["rl"]["critic"] == "llama3-70b"
    assert estimate_rl(other.spec()).phases_s["critic_update"] > 0
    same = import_verl(base + "critic.model.path=/ckpt/llama3-8b-Instruct", response_len=200)
    assert "critic" not in same.tables["rl"]  # the actor's shape: rl.critic stays unset


def test_verls_dapo_recipe_generates_a_round_of_its_gen_batch():
    """verl's own DAPO recipe script (recipe.dapo.main_dapo): data.gen_batch_size 3 x 512 prompts
    a round with the group filter on, 512 trained on; the fewest rounds (one) are priced, and
    the rollout of the larger round costs more than the trained prompts alone would."""
    imported = import_verl((DATA / "verl_dapo_qwen2.5_32b.sh").read_text(), model="qwen3-32b")
    rl = imported.tables["rl"]
    assert rl["prompts_per_step"] == 512 and rl["generation_batch"] == 3 * 512
    assert rl["generation_rounds"] == 1
    assert any("dynamic sampling" in n for n in imported.notes)
    spec = imported.spec()
    assert spec.rl.generated_samples_per_step == 3 * 512 * 16
    assert spec.rl.samples_per_step == 512 * 16  # what the update and log-prob passes see
    est = estimate_rl(spec)
    plain = estimate_rl(replace(spec, rl=replace(spec.rl, generation_batch=None)))
    assert est.phases_s["rollout"] > plain.phases_s["rollout"]
    for phase in ("update", "old_logprob"):
        assert est.phases_s[phase] == plain.phases_s[phase]


@pytest.mark.parametrize(
    ("extra", "prompts", "batch", "rounds"),
    [
        ("data.gen_batch_size=200 algorithm.filter_groups.enable=True", 512, 200, 3),
        ("algorithm.filter_groups.enable=True", 512, None, 1),
        ("data.gen_batch_size=256", 256, None, 1),  # no filter: every generated prompt trains
    ],
)
def test_dapo_rounds_are_the_fewest_that_keep_the_train_batch(extra, prompts, batch, rounds):
    base = (
        "python3 -m recipe.dapo.main_dapo algorithm.adv_estimator=grpo data.train_batch_size=512 "
        "actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.ppo_mini_batch_size=128 "
        "actor_rollout_ref.actor.use_dynamic_bsz=True "
    )
    rl = import_verl(base + extra, model="qwen2.5-7b", response_len=300).tables["rl"]
    assert rl["prompts_per_step"] == prompts
    assert rl.get("generation_batch") == batch
    assert rl.get("generation_rounds", 1) == rounds


def test_dapo_rounds_beyond_its_own_cap_are_refused_and_main_ppos_filter_is_named():
    command = (
        "python3 -m recipe.dapo.main_dapo data.train_batch_size=512 data.gen_batch_size=100 "
        "algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=4 "
        "actor_rollout_ref.actor.use_dynamic_bsz=True algorithm.filter_groups.enable=True "
        "algorithm.filter_groups.max_num_gen_batches=4"
    )
    with pytest.raises(SpecError) as err:
        import_verl(command, model="qwen2.5-7b")
    assert err.value.field == "algorithm.filter_groups.max_num_gen_batches"
    ppo = command.replace("recipe.dapo.main_dapo", "verl.trainer.main_ppo")
    imported = import_verl(ppo, model="qwen2.5-7b")
    assert "algorithm.filter_groups.enable" in imported.unpriced
    assert "generation_batch" not in imported.tables["rl"]


def test_a_script_that_runs_no_verl_entry_is_named_not_read_as_yaml():
    with pytest.raises(SpecError) as err:
        import_verl("#!/usr/bin/env bash\nset -x\npython3 -m my.trainer a=1\n", model="qwen2.5-7b")
    assert "recipe.dapo.main_dapo" in err.value.allowed and "OmegaConf" not in err.value.allowed


def test_a_recipe_script_ending_in_a_line_continuation_imports():
    """verl's test_dapo_8b_megatron_fp8train.sh ends `"${FORWARD_ONLY_SETS[@]}" \\` with no
    line after it: bash runs the command, and so does the reader."""
    text = (DATA / "verl_dapo_8b_megatron_fp8train.sh").read_text()
    assert text.rstrip(" ").endswith("\\")
    imported = import_verl(text, model="llama3-8b")
    assert imported.tables["parallel"]["tp"] >= 1
    assert estimate_rl(imported.spec()).step_time_s > 0


def test_dynamic_sampling_is_not_exported_to_main_ppo(tmp_path):
    imported = import_verl((DATA / "verl_dapo_qwen2.5_32b.sh").read_text(), model="qwen3-32b")
    from aihpc.interop.verl_export import export_verl

    with pytest.raises(SpecError) as err:
        export_verl(imported.spec())
    assert err.value.field == "rl.generation_batch"


def test_verl_and_slime_megatron_pipelines_exchange_each_microbatchs_shape():
    """verl's Megatron config and slime's validate_args always set Megatron's
    variable_seq_lengths: the import writes it; verl's FSDP actor has no pipeline to pad; an
    exported Megatron plan is priced with it, as verl runs it."""
    from aihpc.interop.verl_export import verl_as_run

    megatron = import_verl(
        (DATA / "verl_qwen2_7b_megatron_offload.sh").read_text(), model="llama3-8b"
    )
    assert megatron.tables["rl"]["variable_seq_lengths"] is True
    fsdp = import_verl((DATA / "verl_qwen2_14b_fsdp_offload.sh").read_text(), model="llama3-8b")
    assert "variable_seq_lengths" not in fsdp.tables["rl"]
    slime = import_slime((DATA / "slime_qwen3_30b_colocated.sh").read_text(), model="qwen3-30b-a3b")
    assert slime.tables["rl"]["variable_seq_lengths"] is True
    spec = megatron.spec()
    plain = replace(spec, rl=replace(spec.rl, variable_seq_lengths=False))
    flat = replace(plain, parallel=replace(plain.parallel, pp=1))
    as_run, changes = verl_as_run(flat)
    assert as_run.rl.variable_seq_lengths and not changes  # no pipeline: the same price
    piped = replace(plain, parallel=replace(plain.parallel, pp=2))
    as_run, changes = verl_as_run(piped)
    assert as_run.rl.variable_seq_lengths and "rl.variable_seq_lengths = false -> true" in changes
    assert estimate_rl(as_run).phases_s["update"] < estimate_rl(piped).phases_s["update"]
