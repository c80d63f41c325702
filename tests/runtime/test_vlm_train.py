"""The trainer's tiny vision-language model (runtime/vlm/) under the plans it runs, for real (4
gloo processes, fp32 on CPU), against the same model trained by one process: the loss at each of
8 steps and every parameter (encoder, projector, decoder) at the end; a kill and resume that ends
bitwise on the uninterrupted run's state; and the refusals of what it does not run.

Tolerance: test_nd_parity's (2e-6 relative on losses, 5e-5 absolute on parameters), for the
same reason: each plan computes the same mean gradient of the same global batch, only summed in
another order. Measured while writing this (10 plans, including these): losses within 1.5e-7
relative, parameters within 1.3e-5 absolute (the decoder's w2 under tensor parallel).

Samples carry 0, 1 or 2 images, so the data-parallel ranks encode unequal numbers of images in
a step (the summary's measured imbalance).
"""

from __future__ import annotations

import json

import pytest
from test_nd_parity import LOSS_RTOL, PARAM_ATOL, losses, model_params, train_plans
from train_cli import train as run_train
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.rules import trainer_refusal
from aihpc.runspec.tomlw import dumps_toml


def heavy(test):
    """As test_nd_parity's: one torchrun trains every plan (the module's fixture, bounded by
    its own budget stretched by the load, tests/hang_bounds.py); the per-test bound is above."""
    return pytest.mark.slow(pytest.mark.timeout(900)(test))


STEPS = 8
VISION = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "ffn_hidden_size": 64,
    "patch_size": 4,
    "image_size": 16,
    "projector_hidden": 64,
}
BASE = {
    "model": {
        "preset": "tiny-llama",
        "num_layers": 4,
        "num_kv_heads": 4,
        "seq_length": 64,
        "vision": VISION,
    },
    "multimodal": {
        "images_per_sample": {"values": [0, 1, 2], "weights": [0.3, 0.4, 0.3]},
        "image_tokens": 16,
        "packing": False,
        "padding": "max",
    },
    "cluster": {"gpu": "h100-sxm", "num_gpus": 4, "gpus_per_node": 4},
    "training": {"train_steps": STEPS, "learning_rate": 3e-3, "warmup_steps": 2, "seed": 7},
    "checkpoint": {"interval_steps": STEPS // 2, "async_save": False},
}
COMMON = {"micro_batch_size": 1, "global_batch_size": 8}
MB2 = {"micro_batch_size": 2}
PLANS = {
    "dp4-ddp": {"zero_stage": 0},
    "dp4-fsdp": {"zero_stage": 3},
    "tp2sp-dp2": {"tp": 2, "zero_stage": 1, **MB2},
    "pp2-dp2": {"pp": 2, "zero_stage": 1, **MB2},
    "cp2-dp2": {"cp": 2, "zero_stage": 3, **MB2},
    "tp2sp-pp2": {"tp": 2, "pp": 2, "zero_stage": 1, **MB2},
    "tp2-cp2": {"tp": 2, "cp": 2, "zero_stage": 1, **MB2},
}


def _write(path, table: dict):
    path.write_text(dumps_toml(table))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm-ref")
    one = {**BASE["cluster"], "num_gpus": 1, "gpus_per_node": 1}
    spec = _write(d / "ref.toml", {**BASE, "cluster": one, "parallel": {**COMMON}})
    proc = run_train(spec, d / "run", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(d / "run"), model_params(d / "run"), json.loads(proc.stdout)


@pytest.fixture(scope="module")
def plan_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm-plans")
    plans = {name: {**COMMON, **table} for name, table in PLANS.items()}
    return out, train_plans(out, BASE, plans, 600)


@heavy
@pytest.mark.parametrize("name", list(PLANS))
def test_vlm_plan_matches_single_process(plan_runs, reference, name):
    out, proc = plan_runs
    result_file = out / f"{name}.json"
    assert result_file.exists(), f"plan {name} did not run:\n{proc.stderr[-3000:]}"
    result = json.loads(result_file.read_text())
    assert result["ok"], result.get("error")
    ref_losses, ref_params, _ = reference
    got = losses(out / name)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, ref_losses, strict=True), 1):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: {a} vs {b}"
    params = model_params(out / name)
    assert params.keys() == ref_params.keys()
    assert any(k.startswith("vision.blocks.") for k in params)  # the encoder is compared too
    for fqn, ref in ref_params.items():
        diff = (params[fqn] - ref).abs().max().item()
        assert diff <= PARAM_ATOL, f"{fqn}: max |difference| {diff:.3g}"
    plan, table = result["plan"], PLANS[name]
    for axis in ("tp", "pp", "cp"):
        assert plan[axis] == table.get(axis, 1)
    measured = result["performance"]["imbalance"]["measured"]
    # the encoder runs on every rank of the first stage: dp x tp x cp of them
    assert measured["encoder_ranks"] == 4 // plan["pp"]
    if plan["dp"] > 1:  # unequal images per data-parallel rank: the slowest encodes more
        assert measured["images_per_rank_max"] > measured["images_per_rank_mean"]


@heavy
def test_vlm_training_learns_the_captions(reference):
    """Over 8 steps the loss falls (the captions follow the images; a sanity check that the
    images reach the loss, which the parity above compares exactly)."""
    ref_losses, _, summary = reference
    assert min(ref_losses[-2:]) < ref_losses[0]
    assert summary["performance"]["placement"] == "replicated"


@heavy
def test_vlm_kill_and_resume_is_bitwise(tmp_path, plan_runs):
    """tp2 x pp2 with sequence parallel, the encoder on the first stage: a rank killed after
    step 5 (step 4 committed), the agent restarts the job, which ends on the uninterrupted run's
    state hash and losses, bit for bit."""
    out, _ = plan_runs
    uninterrupted = json.loads((out / "tp2sp-pp2.json").read_text())
    spec = _write(tmp_path / "run.toml", {**BASE, "parallel": {**COMMON, **PLANS["tp2sp-pp2"]}})
    proc = run_train(
        spec, tmp_path / "run", "--nproc-per-node", "4", "--max-restarts", "1",
        "--inject", "kill:step=5:rank=3", env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 4
    assert summary["state_sha256"] == uninterrupted["state_sha256"]
    assert losses(tmp_path / "run") == losses(out / "tp2sp-pp2")


REFUSED = [
    ({"parallel": {"pp": 2, "vpp": 2, "pp_schedule": "zbv"}}, "parallel.pp_schedule"),
    ({"multimodal": {"packing": True}}, "multimodal.packing"),
    ({"multimodal": {"image_tokens": 64}}, "multimodal.image_tokens"),
    ({"multimodal": {"placement": "pool"}}, "multimodal.placement"),
    ({"multimodal": {"freeze_encoder": True}}, "multimodal.freeze_encoder"),
    ({"vision": {"merge": 2}}, "model.vision.merge"),
    ({"vision": {"ffn_activation": "swiglu"}}, "model.vision.ffn_activation"),
]


@pytest.mark.parametrize(("change", "field"), REFUSED)
def test_what_the_vlm_trainer_does_not_run_exits_2(tmp_path, change, field):
    """Refused in one line naming the field, by the rule set the planner shares."""
    table = json.loads(json.dumps({**BASE, "parallel": {**COMMON}}))
    table["parallel"].update(change.get("parallel", {}))
    table["multimodal"].update(change.get("multimodal", {}))
    table["model"]["vision"].update(change.get("vision", {}))
    problem = trainer_refusal(runspec_from_dict(table))
    assert problem is not None and problem.field == field
    spec = _write(tmp_path / "bad.toml", table)
    result = CliRunner().invoke(app, ["train", str(spec), "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert field in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_search_marks_the_vlm_plans_the_trainer_runs(tmp_path):
    """`aihpc search` of a VLM spec marks each (plan, placement) by the trainer's rules, and
    --runnable keeps only those it runs: the encoder replicated on the first stage."""
    spec = _write(tmp_path / "s.toml", {**BASE, "parallel": {**COMMON}})
    every = CliRunner().invoke(app, ["search", str(spec), "--top", "40", "--json"])
    assert every.exit_code == 0, every.output
    plans = json.loads(every.stdout)["plans"]
    refused = [p for p in plans if not p["runnable"]]
    assert refused and all(p["trainer_refuses"] for p in refused)
    assert any(p["placement"] in ("pool", "stage", "bubble") for p in refused)
    runnable = CliRunner().invoke(app, ["search", str(spec), "--top", "40", "--json", "--runnable"])
    assert runnable.exit_code == 0, runnable.output
    kept = json.loads(runnable.stdout)["plans"]
    assert kept and all(p["runnable"] for p in kept)
    assert {p["placement"] for p in kept} <= {"replicated", "tp"}
    for p in kept:  # each one, as a run spec's [parallel], is one the trainer takes
        table = {**BASE, "parallel": p["plan"]}
        assert trainer_refusal(runspec_from_dict(table)) is None, p["plan"]
