"""Published expert loads (data/expert_load.csv): the readings keep what their source states, and
a serving row that names one is priced on it."""

from __future__ import annotations

import json

import pytest

from aihpc.perf.infer.expert_load import expert_load, expert_loads
from aihpc.perf.infer.routing import routing_imbalance_floor
from aihpc.perf.infer.validate import load_rows, predict_row
from aihpc.runspec import SpecError
from aihpc.runspec.model import model_from_table

DSV3 = model_from_table({"preset": "deepseek-v3"})


def _series(figure: str, eplb: bool) -> list[float]:
    points = [p for p in expert_loads().values() if p.figure == figure and p.eplb == eplb]
    return [p.balancedness for p in sorted(points, key=lambda p: p.gpus)]


def test_the_scale_figure_reads_as_its_text_says() -> None:
    # The blog: "utilization rate decreases when the system scales with the number of nodes, and
    # enabling EPLB significantly improves the utilization".
    default = _series("eplb-balancedness", eplb=False)
    assert len(default) == 4 and default == sorted(default, reverse=True)
    by_gpus = {(p.gpus, p.eplb): p.balancedness for p in expert_loads().values()}
    for gpus in (8, 16, 32):
        assert by_gpus[(gpus, True)] > by_gpus[(gpus, False)]
    for p in expert_loads().values():
        assert len(p.source) > 40 and p.reading and p.kind in ("simulation", "measured")


def test_a_published_load_sits_above_the_chance_floor_of_its_scale() -> None:
    # The floor is balanced routing's busiest GPU (routing.py); a learned router's skew adds to it.
    for p in expert_loads().values():
        tokens = 16384 * p.gpus if p.figure == "eplb-balancedness" else 256 * p.gpus
        assert p.imbalance > routing_imbalance_floor(DSV3, p.gpus, tokens)


def test_a_load_is_refused_at_another_scale_or_when_unknown() -> None:
    assert expert_load("lmsys-scale-ep32-eplb", 32).imbalance == pytest.approx(1 / 0.8)
    with pytest.raises(SpecError) as err:
        expert_load("lmsys-scale-ep32-eplb", 64)
    assert err.value.field == "expert_load" and "ep = 64" in str(err.value)
    with pytest.raises(SpecError, match="lmsys-scale-ep8-eplb"):
        expert_load("no-such-load", 32, "row[3].expert_load")


def test_a_row_naming_a_load_is_priced_on_it(tmp_path) -> None:
    rows = {r["id"]: r for r in load_rows()}
    default = rows["sglang-dsv3-prefill-h100-ep32-4k"]
    balanced = rows["sglang-dsv3-prefill-h100-ep32-4k-balanced"]
    assert default["expert_load"] and "expert_load" not in balanced
    same = {k: v for k, v in default.items() if k != "expert_load"}
    load = expert_load(default["expert_load"], default["ep"])
    assert predict_row(default) == pytest.approx(
        predict_row({**same, "moe_imbalance": load.imbalance})
    )
    assert predict_row(default) < predict_row(balanced)  # the same run, skewed experts
    both = tmp_path / "rows.toml"
    lines = [f"{k} = {json.dumps(v)}" for k, v in default.items()]  # TOML writes these alike
    both.write_text("[[row]]\n" + "\n".join(lines) + "\nmoe_imbalance = 1.3\n")
    with pytest.raises(SpecError) as err:
        load_rows(both)
    assert err.value.field == "row[0].moe_imbalance"
