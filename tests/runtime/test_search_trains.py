"""What `aihpc search` prints, `aihpc train` runs (issue 41 item 1): one rule set
(``aihpc.runspec.rules``) marks every plan the search prints and is what the trainer checks
before it starts, so for a tiny dense model, a tiny MoE model and one that drops tokens, on 4 GPUs

- each plan the search prints is marked runnable exactly when the trainer's own check accepts
  it, and a refused plan is refused by the trainer with the same line;
- ``--runnable`` keeps exactly the runnable ones (dense: the same plans; MoE: the trainer's
  MoE options offered instead of the ones it refuses);
- a sample of the runnable plans (the best plan of each distinct shape, four per model), trained
  for real by 4 gloo processes for 2 steps, runs and matches one process trained on the same
  global batch, loss for loss, within test_nd_parity's tolerance (2e-6 relative: the same mean
  gradient summed in another order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_nd_parity import losses

from aihpc.perf.search.ranking import search
from aihpc.runspec import ParallelPlan, SpecError, runspec_from_dict
from aihpc.runspec.rules import trainer_plan_rule
from aihpc.runtime.checks import check_plan
from aihpc.runtime.distributed import free_port
from hang_bounds import hang_guard_s

LOSS_RTOL = 2e-6
STEPS = 2
SAMPLE = 4
CLUSTER = {"gpu": "h100-sxm", "num_gpus": 4, "gpus_per_node": 4}
TRAINING = {"train_steps": STEPS, "learning_rate": 3e-3, "warmup_steps": 1, "seed": 7}
MOE = {
    "num_experts": 4,
    "moe_top_k": 2,
    "moe_ffn_hidden_size": 32,
    "num_shared_experts": 1,
    "moe_router_score_function": "sigmoid",
    "moe_router_bias_update_rate": 0.01,
}
SPECS = {
    "dense": {"preset": "tiny-llama", "num_layers": 4, "num_kv_heads": 2, "seq_length": 32},
    "moe": {"preset": "tiny-llama", "seq_length": 32, **MOE},
    # token dropping: capacity 8 copies of each 32-token sequence per expert, half the balanced
    # share, so every step drops (tests/runtime/test_moe_capacity.py checks the choice)
    "moe-capacity": {"preset": "tiny-llama", "seq_length": 32, **MOE, "moe_capacity_factor": 0.5},
}


def _base(model: dict) -> dict:
    return {
        "model": model,
        "cluster": CLUSTER,
        "training": TRAINING,
        "checkpoint": {"interval_steps": STEPS, "async_save": False},
    }


def _spec(name: str, parallel: dict | None = None):
    return runspec_from_dict(
        {**_base(SPECS[name]), "parallel": parallel or {"global_batch_size": 8}}
    )


def _key(plan: ParallelPlan) -> tuple:
    return tuple(sorted(plan.as_dict().items()))


@pytest.mark.parametrize("name", list(SPECS))
def test_every_printed_plan_is_marked_as_the_trainer_decides(name):
    spec = _spec(name)
    plans = [e.plan for e in search(spec).plans]
    rule = trainer_plan_rule(spec.model, spec.training, spec.cluster.num_gpus)
    runnable, refused = [], []
    for plan in plans:
        one = runspec_from_dict(
            {**_base(SPECS[name]), "parallel": _table(plan)}
        )  # the plan as `search -o` writes it
        answer = rule(plan)
        try:
            check_plan(one, spec.cluster.num_gpus)
        except SpecError as err:
            assert answer is not None and str(answer) == str(err), (plan, answer, err)
            refused.append(plan)
        else:
            assert answer is None, (plan, answer)
            runnable.append(plan)
    assert runnable and plans
    kept = [e.plan for e in search(spec, runnable=True).plans]
    assert all(rule(p) is None for p in kept)
    if name == "dense":  # no MoE option to swap: --runnable is the marked plans, in order
        assert [_key(p) for p in kept] == [_key(p) for p in runnable]
    else:
        assert {_key(p) for p in runnable} <= {_key(p) for p in kept}


def _table(plan: ParallelPlan) -> dict:
    table = plan.as_dict()
    table["recompute_modules"] = list(table["recompute_modules"])
    return table


# The sample: the best runnable plan overall, then the best one with each of these (a plan
# already taken is not taken twice), until SAMPLE plans.
WANTED = {
    "best": lambda p: True,
    "pp": lambda p: p.pp > 1,
    "tp": lambda p: p.tp > 1,
    "cp": lambda p: p.cp > 1,
    "ep": lambda p: p.ep > 1,
    "zero3": lambda p: p.zero_stage == 3,
    "recompute": lambda p: p.recompute != "none",
}


def _sample(name: str) -> dict[str, dict]:
    ranked = [e.plan for e in search(_spec(name), runnable=True).plans]
    out: dict[str, dict] = {}
    for label, wanted in WANTED.items():
        pick = next((p for p in ranked if wanted(p) and _table(p) not in out.values()), None)
        if pick is not None:
            out[label] = _table(pick)
        if len(out) == SAMPLE:
            break
    return out


def _nd_worker(out: Path, nproc: int, plans: dict, bases: dict) -> subprocess.CompletedProcess:
    """nd_worker.py over ``plans`` (each trained from its own base spec) in one torchrun."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), str(Path(__file__).parent / "nd_worker.py"),
        str(out), json.dumps(next(iter(bases.values()))), json.dumps(plans), json.dumps(bases),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hang_guard_s(600))


@pytest.fixture(scope="module")
def sample_runs(tmp_path_factory) -> tuple[Path, dict, dict]:
    """Every model's sample of plans in one torchrun of 4 processes, and every model's
    one-process reference (the same global batch) in one of 1: each plan and reference still
    trains from a fresh model and run directory (nd_worker.py), only the interpreters, torch
    and the process group are shared, started twice instead of six times."""
    out = tmp_path_factory.mktemp("search-trains")
    one = {**CLUSTER, "num_gpus": 1, "gpus_per_node": 1}
    parallel = {"micro_batch_size": 1, "global_batch_size": 8, "zero_stage": 0}
    plans, bases, refs, ref_bases = {}, {}, {}, {}
    for name, model in SPECS.items():
        for label, table in _sample(name).items():
            plans[f"{name}.{label}"], bases[f"{name}.{label}"] = table, _base(model)
        refs[f"{name}.ref"], ref_bases[f"{name}.ref"] = parallel, {**_base(model), "cluster": one}
    procs = {"ref": _nd_worker(out, 1, refs, ref_bases), "plans": _nd_worker(out, 4, plans, bases)}
    return out, plans, procs


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(SPECS))
def test_a_sample_of_the_search_trains_as_one_process(name, sample_runs):
    out, all_plans, procs = sample_runs
    plans = [p for p in all_plans if p.startswith(f"{name}.")]
    assert len(plans) == SAMPLE, plans
    ref = out / f"{name}.ref.json"
    assert ref.exists() and json.loads(ref.read_text())["ok"], procs["ref"].stderr[-3000:]
    expected = losses(out / f"{name}.ref")
    assert len(expected) == STEPS
    for plan in plans:
        result_file = out / f"{plan}.json"
        assert result_file.exists(), f"plan {plan} did not run:\n{procs['plans'].stderr[-3000:]}"
        assert json.loads(result_file.read_text())["ok"]
        got = losses(out / plan)
        assert len(got) == STEPS
        for step, (a, b) in enumerate(zip(got, expected, strict=True), 1):
            assert abs(a - b) <= LOSS_RTOL * abs(b), f"{plan} step {step}: {a} vs {b}"
