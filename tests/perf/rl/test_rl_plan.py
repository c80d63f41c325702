"""The [rl] section's rules and the RL step's phases (perf/rl)."""

from __future__ import annotations

import copy

import pytest
from rl_base_spec import BASE
from rl_base_spec import base_spec as _spec

from aihpc.perf.rl import estimate_rl
from aihpc.perf.rl.search import _training_plans, search_rl
from aihpc.runspec import SpecError, runspec_from_dict


@pytest.mark.parametrize(
    ("rl", "field"),
    [
        ({"staleness": 1}, "rl.staleness"),
        ({"placement": "disaggregated"}, "rl.rollout_gpus"),
        ({"placement": "disaggregated", "rollout_gpus": 32}, "rl.rollout_gpus"),
        ({"placement": "disaggregated", "rollout_gpus": 12}, "rl.rollout_gpus"),
        ({"samples_per_prompt": 1}, "rl.samples_per_prompt"),
        ({"max_response_len": 100}, "rl.max_response_len"),
        ({"reward": "model"}, "rl.reward_model"),
        ({"algorithm": "dpo"}, "rl.algorithm"),
        ({"prompts_per_step": 3}, "parallel.global_batch_size"),
        ({"rollout": {"tp": 3}}, "rl.rollout"),
        ({"rollout": {"gpu_memory_utilization": 1.5}}, "rl.rollout.gpu_memory_utilization"),
        ({"bogus": 1}, "rl.bogus"),
    ],
)
def test_bad_rl_names_the_field(rl, field):
    with pytest.raises(SpecError) as err:
        _spec(**rl)
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_phases_add_up_when_synchronous():
    est = estimate_rl(_spec())
    assert est.step_time_s == pytest.approx(sum(est.phases_s.values()))
    assert est.phases_s["rollout"] > 0 and est.phases_s["update"] > 0
    assert est.phases_s["old_logprob"] < est.phases_s["update"]  # forward only < fwd + bwd


def test_async_step_is_the_slower_pool_plus_sync():
    est = estimate_rl(_spec(placement="disaggregated", rollout_gpus=16, staleness=1))
    train = sum(v for k, v in est.phases_s.items() if k not in ("rollout", "weight_sync"))
    expected = max(est.phases_s["rollout"], train) + est.phases_s["weight_sync"]
    assert est.step_time_s == pytest.approx(expected)
    assert est.phases_s["switch"] == 0.0  # nothing to offload: the pools are apart


def test_no_kl_drops_the_reference_pass_and_ppo_adds_a_critic():
    assert estimate_rl(_spec(kl=False)).phases_s["ref_logprob"] == 0.0
    ppo = estimate_rl(_spec(algorithm="ppo"))
    assert ppo.phases_s["critic_values"] > 0 and ppo.phases_s["critic_update"] > 0


def test_long_tail_costs_more_than_fixed_lengths():
    tail = estimate_rl(_spec(response_dist="lognormal", response_sigma=1.0)).rollout
    flat = estimate_rl(_spec(response_dist="fixed")).rollout
    assert tail.time_s > flat.time_s


def test_staleness_bound_keeps_each_steps_own_tail():
    def pool(k):
        return estimate_rl(_spec(placement="disaggregated", rollout_gpus=16, staleness=k))

    sync, one, two = (pool(k) for k in (0, 1, 2))
    # one step off: a step's samples start only with the weights one step old, so its own batch
    # (its longest response) must finish within one training period: no tail is hidden (two
    # steps' requests streamed together may take longer a step than one step's batch run at once:
    # they do not all fit the KV cache together, perf/infer/rollout.py)
    assert one.phases_s["rollout"] >= sync.phases_s["rollout"] * (1 - 1e-9)
    assert one.step_time_s < sync.step_time_s  # the pools still work side by side
    # two steps off: the batch has two periods, the tail is split over them
    assert two.phases_s["rollout"] < one.phases_s["rollout"]


def test_search_ranks_fitting_layouts_fastest_first():
    found = search_rl(_spec())
    steps = [e.step_time_s for e in found.ranked]
    assert steps and steps == sorted(steps)
    assert {e.rl.placement for e in found.ranked} == {"colocated", "disaggregated"}


def test_search_offers_verl_its_state_kept_on_the_gpus(tmp_path):
    """Colocated under verl's offload, the search also prices the state kept on the GPUs
    (verl's default, offload none) and keeps both where they fit; `-o` writes the choice."""
    from aihpc.cli.rl import write_rl_layout
    from aihpc.runspec import load_runspec

    data = copy.deepcopy(BASE)
    data["rl"].update(offload="verl-megatron")
    data["rl"]["rollout"].update(gpu_memory_utilization=0.5)
    spec = runspec_from_dict(data)
    found = search_rl(spec)
    colocated = {e.rl.offload: e for e in found.ranked if e.rl.placement == "colocated"}
    assert set(colocated) == {"verl-megatron", "none"}
    kept, moved = colocated["none"], colocated["verl-megatron"]
    assert kept.phases_s["update"] < moved.phases_s["update"]  # no state moved in the phase
    src = tmp_path / "run.toml"
    src.write_text(
        '[model]\npreset = "qwen3-30b-a3b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 64\n'
        "[parallel]\nglobal_batch_size = 512\n[rl]\nprompts_per_step = 64\n"
        "samples_per_prompt = 32\nprompt_len = 256\nresponse_len = 2900\n"
        'max_response_len = 3840\noffload = "verl-megatron"\n'
        "[rl.rollout]\ntp = 8\ngpu_memory_utilization = 0.5\n"
    )
    out = tmp_path / "best.toml"
    write_rl_layout(load_runspec(src), kept, out)
    assert load_runspec(out).rl.offload == "none"


def test_weight_sync_pays_per_tensor_not_only_bytes():
    from aihpc.perf.rl.phases import checkpoint_tensors, sync_s

    spec = _spec(placement="disaggregated", rollout_gpus=16)
    assert spec.rl is not None
    moe = checkpoint_tensors(spec.model)
    assert moe > 3 * spec.model.num_experts * spec.model.num_moe_layers  # 3 per expert
    fast = sync_s(spec.model, spec.cluster, spec.rl, 16)
    bigger_nic = spec.cluster.__class__(**{**spec.cluster.__dict__, "scale_out_bw_GBps": 1e6})
    assert 0 < sync_s(spec.model, bigger_nic, spec.rl, 16) < fast  # bytes still cost


def test_refit_rows_have_sources_and_a_prediction():
    from aihpc.perf.fit.rl_validate import validate_refit

    rows = validate_refit()
    assert len(rows) >= 3
    assert all(r.source and r.predicted_s > 0 for r in rows)


def test_zero3_forward_passes_gather_the_parameters():
    data = copy.deepcopy(BASE)
    data["parallel"] = {"zero_stage": 3, "global_batch_size": 512}
    zero3 = estimate_rl(runspec_from_dict(data))
    data["parallel"] = {"zero_stage": 1, "global_batch_size": 512}
    zero1 = estimate_rl(runspec_from_dict(data))
    gap3 = zero3.phases_s["old_logprob"] - zero3.actor.forward.time_s["compute"] / 3
    gap1 = zero1.phases_s["old_logprob"] - zero1.actor.forward.time_s["compute"] / 3
    assert gap3 > gap1  # the forward's all-gather is paid under ZeRO-3 only


def test_rl_targets_hold_on_the_dev_rows():
    """The rows the model was developed on meet issue 39's targets (MAPE <= 20%, none beyond
    40%); the held-out rows do not yet (below)."""
    from aihpc.perf.fit.rl_validate import validate_rl

    report = validate_rl()
    assert report.mape("dev") <= 0.20 and report.worst("dev") <= 0.40


@pytest.mark.xfail(
    strict=True,
    reason="issue 39's RL targets (MAPE <= 20%, no row beyond 40%) are not met on the held-out "
    "rows yet: see docs/rl.md, Checked against published RL runs",
)
def test_rl_targets():
    from aihpc.perf.fit.rl_validate import validate_rl

    report = validate_rl()
    assert report.mape() <= 0.20 and report.worst() <= 0.40


def test_every_rl_row_names_its_source_and_is_priced():
    from aihpc.perf.fit.rl_validate import validate_rl

    report = validate_rl()
    assert len(report.rows) >= 10
    assert all(r.source and r.predicted_s > 0 for r in report.rows)
    assert {r.set for r in report.rows} == {"dev", "heldout"}


def test_published_phase_breakdowns_are_priced_phase_by_phase():
    from aihpc.perf.fit.rl_validate import PHASES, validate_phases, validate_rl

    runs = {r.id: r for r in validate_rl().rows}
    phases = validate_phases()
    assert len(phases) >= 4
    for p in phases:
        assert p.source and p.id in runs
        assert set(p.measured) == set(p.predicted) == set(PHASES)
        assert all(v > 0 for v in p.measured.values())
        # the phases priced are the step's own: together no more than its critical path
        assert sum(p.predicted.values()) <= runs[p.id].predicted_s


def test_each_row_is_batched_as_its_recipe_says(tmp_path):
    """The ``batching`` column (the recipe's sequence packing on or off) reaches the step model:
    the row's passes are priced on padded micro-batches where the recipe turned packing off, and
    a value outside runspec.rl.BATCHINGS is one clear error naming the file, the row and the
    field."""
    import csv

    from aihpc.perf.fit.rl_validate import _default_csv, rl_runspec, validate_rl
    from aihpc.runspec.errors import SpecError

    with open(_default_csv(), newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    padded = [r for r in table if r["batching"] == "padded"]
    assert padded and all("sequence_packing" in r["source"] for r in padded)
    row = dict(padded[0])
    path = tmp_path / "one.csv"
    for how in ("padded", "packed"):
        row["batching"] = how
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            w.writeheader()
            w.writerow(row)
        priced = validate_rl(path).rows[0]
        if how == "padded":
            padded_s = priced.phases_s["update"]
    assert padded_s > priced.phases_s["update"]  # the padding is computed too
    absent = {k: v for k, v in row.items() if k != "batching"}
    assert "batching" not in rl_runspec(absent)["rl"]  # the spec's default: packed (NeMo-RL's)
    row["batching"] = "dynamic"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        w.writeheader()
        w.writerow(row)
    with pytest.raises(SpecError) as err:
        validate_rl(path)
    assert err.value.field == f"one.csv row {row['id']}: rl.batching"
    assert err.value.value == "dynamic"


def test_each_rows_training_facts_reach_its_run_spec():
    """The moe_stack and cuda_graphs columns become the row's [training] (empty: not stated):
    every MoE row runs Megatron-Core's alltoall dispatcher, no row a training CUDA graph."""
    import csv

    from aihpc.perf.fit.rl_validate import _default_csv, rl_runspec
    from aihpc.runspec.runspec import runspec_from_dict

    with open(_default_csv(), newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    for row in table:
        spec = runspec_from_dict(rl_runspec(row))
        assert spec.training.cuda_graphs == (row["cuda_graphs"] or "unknown")
        assert spec.training.moe_stack == (row["moe_stack"] or "unknown")
        assert (row["moe_stack"] != "") == spec.model.is_moe
    row = dict(table[0], moe_stack="", cuda_graphs="")
    assert "training" not in rl_runspec(row)


def test_search_keeps_every_tp_for_a_bin_of_odd_length():
    """A packed bin of 150 + 8,192 tokens is not a multiple of 4: the training search's probe
    is padded so that tp 4 and 8 still split it under sequence parallelism (before, a spec that
    fixed tp 4 found no layout at all, and a free one lost tp 4 and 8)."""
    data = {
        "model": {"preset": "qwen2.5-7b"},
        "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
        "parallel": {"tp": 4, "global_batch_size": 512},
        "rl": {
            "prompts_per_step": 512,
            "samples_per_prompt": 16,
            "prompt_len": 150,
            "response_len": 556,
            "max_response_len": 8192,
            "kl": False,
            "offload": "none",
            "rollout": {"tp": 1},
        },
    }
    fixed = search_rl(runspec_from_dict(data), top_plans=2)
    assert fixed.ranked and {e.plan.tp for e in fixed.ranked} == {4}
    del data["parallel"]["tp"]
    free = runspec_from_dict(data)
    offered = {p.tp for p in _training_plans(free, free.rl, top=200)}
    assert 4 in offered
