"""Every run-spec field, set to values of the wrong kind or out of range, must give either a
valid answer (finite JSON; exit 0, or 1 for a plan that does not fit) or exit 2 with one line
naming the field: never a traceback. The sweep found `calibration = 2`, `preset = [1, 2]` and a
1e308 s checkpoint interval crashing before it was a test.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.inference import InferenceSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import PartialPlan
from aihpc.runspec.reliability import ReliabilitySpec
from aihpc.runspec.training import CheckpointSpec, TrainingSpec

BASE = {
    "model": {"preset": "tiny-llama"},
    "cluster": {"gpu": "h100-sxm", "num_gpus": 2, "gpus_per_node": 2},
    "parallel": {"zero_stage": 3, "micro_batch_size": 4, "global_batch_size": 16},
    "training": {"precision": "bf16"},
}
CUSTOM_GPU = {
    "bf16_tflops": 989.0,
    "hbm_gib": 80.0,
    "hbm_bw_GBps": 3350.0,
    "scale_up_bw_GBps": 450.0,
    "scale_up_domain": 8,
    "scale_out_bw_GBps": 50.0,
}
# wrong kinds, edge and absurd magnitudes, and strings that are valid elsewhere in the spec
VALUES = [
    -1,
    0,
    3,
    2**40,
    2**63 - 1,
    0.5,
    1e308,
    math.inf,
    math.nan,
    "abc",
    "",
    True,
    [1, 2],
    {"a": 1},
]


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)] + ["not_a_field"]


SECTIONS = {
    "model": ["preset", *_fields(ModelSpec)],
    "cluster": ["gpu", "num_gpus", "gpus_per_node", "calibration", "gpu_spec", "not_a_field"],
    "parallel": _fields(PartialPlan),
    "training": _fields(TrainingSpec),
    "checkpoint": _fields(CheckpointSpec),
    "reliability": _fields(ReliabilitySpec),
    "gpu_spec": _fields(GPUSpec),
    "inference": _fields(InferenceSpec),
}
# the command that reads each section (estimate reads the rest)
COMMANDS = {"reliability": "goodput", "checkpoint": "goodput", "inference": "infer"}


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def _toml(doc: dict[str, dict[str, object]]) -> str:
    out = []
    for section, table in doc.items():
        out.append(f"[{section}]")
        nested = {k: v for k, v in table.items() if k == "gpu_spec" and isinstance(v, dict)}
        out += [f"{k} = {_toml_value(v)}" for k, v in table.items() if k not in nested]
        for k, v in nested.items():
            out.append(f"[{section}.{k}]")
            out += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_field_and_bad_value_is_an_estimate_or_one_line(tmp_path, section: str) -> None:
    runner = CliRunner()
    path = tmp_path / "run.toml"
    refused = 0
    for field in SECTIONS[section]:
        for value in VALUES:
            doc = json.loads(json.dumps(BASE))
            if section == "gpu_spec":
                del doc["cluster"]["gpu"]
                doc["cluster"]["gpu_spec"] = {**CUSTOM_GPU, field: value}
            else:
                doc.setdefault(section, {})[field] = value
            path.write_text(_toml(doc))
            command = COMMANDS.get(section, "estimate")
            res = runner.invoke(app, [command, str(path), "--json"])
            case = f"{command} [{section}] {field} = {value!r}"
            assert res.exit_code in (0, 1, 2), f"{case}: exit {res.exit_code}\n{res.output}"
            if isinstance(value, float) and not math.isfinite(value):
                # no field of a run spec has a meaning for inf or nan
                assert res.exit_code == 2, f"{case}: accepted"
            if res.exit_code == 2:
                refused += 1
                lines = res.stderr.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: {lines}"
                assert "Traceback" not in res.output, case
            else:
                out = json.loads(res.stdout)
                # estimate exits 1, after its answer, exactly when the plan does not fit
                assert (res.exit_code == 1) == (out.get("fits") is False), f"{case}: {out}"
                text = json.dumps(out, allow_nan=True)
                assert "NaN" not in text and "Infinity" not in text, f"{case}: {text[:200]}"
    # most of these values are wrong for most fields: a sweep that refused nothing is broken
    assert refused > len(SECTIONS[section]) * len(VALUES) // 2
