"""`aihpc search` and the trainer's rules (aihpc.runspec.rules): every plan printed says whether
`aihpc train` runs it, `--runnable` lists only those, and `-o` writes no plan the trainer
refuses (exit 2, one line naming the refusal) unless `--for` names another framework."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from aihpc.runspec import load_runspec
from aihpc.runspec.rules import trainer_refusal

# pp fixed at 2 with micro-batches of 8: on 2 data-parallel ranks one micro-batch per step,
# which the trainer's pipeline schedules refuse; with cp 2 (dp 1) there are two
SPEC = """
[model]
preset = "tiny-llama"
[cluster]
gpu = "h100-sxm"
num_gpus = 4
gpus_per_node = 4
[parallel]
pp = 2
micro_batch_size = 8
global_batch_size = 16
"""


def aihpc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args], capture_output=True, text=True, timeout=120
    )


def test_each_plan_is_marked_and_runnable_keeps_those_the_trainer_runs(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    every = json.loads(aihpc("search", str(spec), "--top", "100", "--json").stdout)["plans"]
    refused = [p for p in every if not p["runnable"]]
    assert refused and any(p["runnable"] for p in every)
    for p in every:
        assert (p["trainer_refuses"] is None) == p["runnable"]
    assert all("parallel.pp" in p["trainer_refuses"] for p in refused)
    kept = json.loads(aihpc("search", str(spec), "--top", "100", "--runnable", "--json").stdout)
    assert kept["plans"] and all(p["runnable"] for p in kept["plans"])
    assert len(kept["plans"]) == len(every) - len(refused)


def test_output_refuses_a_plan_the_trainer_refuses(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    out = tmp_path / "plan.toml"
    r = aihpc("search", str(spec), "-o", str(out))
    assert r.returncode == 2 and not out.exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--output" in lines[0] and "parallel.pp" in lines[0]
    assert "--runnable" in lines[0]
    r = aihpc("search", str(spec), "--runnable", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert trainer_refusal(load_runspec(out)) is None
