"""Disaggregated and asynchronous GRPO (runtime/rl/pool.py, worker.py) on real processes: rollout
workers of their own, weights broadcast over a gloo group, staleness bounded and recorded per
sample, and the failures: a rollout worker SIGKILLed (the pool restarted, its prompts re-sent)
and the trainer's rank 0 SIGKILLed (the run resumed from its checkpoint, staleness queue and
all). Every comparison is exact: a prompt's samples are one function of (seed, prompt, weights
version), whichever process made them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_rl_run import BASE, _cli, _env, _spec_dict, _write

from hang_bounds import hang_guard_s

STEPS = 12
P, G = 4, 4  # prompts per step, samples per prompt (_spec_dict's)
ARGS = ["--sft-steps", "20", "--task-base", str(BASE)]


def _dis(staleness: int, workers: int = 2, zero_stage: int = 0) -> dict:
    spec = _spec_dict(zero_stage=zero_stage, steps=STEPS, placement="disaggregated",
                      rollout_gpus=workers, staleness=staleness)  # fmt: skip
    spec["cluster"] = {"gpu": "h100-sxm", "num_gpus": 4, "gpus_per_node": 4}
    return spec


def _rows(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.endswith("_s")} for x in lines]


def _samples(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]


def _policy(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / f"rl_{STEPS:08d}.pt", weights_only=True)["policy"]


def _train(tmp: Path, name: str, spec: dict, nproc: int = 1) -> Path:
    run = tmp / name
    done = _cli([str(_write(tmp, f"{name}.toml", spec)), "--run-dir", str(run), *ARGS], nproc)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process each: colocated, disaggregated synchronous (2 workers), asynchronous s = 1."""
    tmp = tmp_path_factory.mktemp("pool")
    return {
        "colocated": _train(tmp, "colocated", _spec_dict(steps=STEPS)),
        "sync": _train(tmp, "sync", _dis(0)),
        "async": _train(tmp, "async", _dis(1)),
    }


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_disaggregated_sync_equals_colocated_and_async_keeps_its_bound(
    runs, tmp_path: Path
) -> None:
    colocated, sync, stale = (runs[k] for k in ("colocated", "sync", "async"))
    # staleness 0 over a process group is the colocated run, step for step and bit for bit
    assert _rows(sync) == _rows(colocated)
    want = _policy(colocated)
    assert all(torch.equal(_policy(sync)[k], want[k]) for k in want)
    assert any(r["reward"] > 0 for r in _rows(sync)), "no sample scored: nothing was learned"
    # asynchronous: batch k from the weights after max(0, k - 1) updates, never older
    rows, samples = _rows(stale), _samples(stale)
    assert rows[0] == _rows(colocated)[0]  # the first batch is version 0 in both
    assert [r["staleness"] for r in rows] == [0] + [1] * (STEPS - 1)
    for line in samples:
        k = line["step"] - 1
        assert set(line["versions"]) == {max(0, k - 1)}
    ids = [i for line in samples for i in line["ids"]]
    assert ids == list(range(STEPS * P * G))  # every sample trained on once
    assert _rows(stale)[1:] != _rows(colocated)[1:]  # off-policy: not the same run
    # a checkpoint whose queue holds batches of staleness 1 does not resume at staleness 0
    again = tmp_path / "again"
    shutil.copytree(stale, again)
    (again / "checkpoints" / f"rl_{STEPS:08d}.pt").unlink()  # the one before holds a queue
    done = _cli([str(_write(tmp_path, "s0.toml", _dis(0))), "--run-dir", str(again), *ARGS])
    assert done.returncode == 2 and "rl.staleness" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def _pids(run: Path) -> tuple[int, list[int]]:
    """(the pool's generation, its worker pids) from rank 0's record."""
    record = json.loads((run / "rollout" / "workers.json").read_text())
    return record["generation"], record["pids"]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigkill_of_a_rollout_worker_then_of_a_trainer_rank_resumes_exactly(
    runs, tmp_path: Path
) -> None:
    """2 FSDP trainer ranks, 2 workers, staleness 1. SIGKILL a worker after step 2: the pool is
    restarted and its prompts re-sent; SIGKILL rank 0 after step 6: the same command resumes
    from the newest checkpoint. The metrics, the samples (each id once) and the final weights
    equal an uninterrupted run's."""
    spec = _dis(1, zero_stage=3)
    straight = _train(tmp_path, "straight", spec, nproc=2)
    first = json.loads((straight / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("reward", "response_len", "rollout_tokens"):  # 2 ranks: the same first samples
        assert first[key] == _rows(runs["colocated"])[0][key], key

    killed = tmp_path / "killed"
    path = _write(tmp_path, "killed.toml", spec)
    cmd = [sys.executable, "-m", "aihpc", "rl", "train", str(path), "--run-dir", str(killed),
           *ARGS, "--nproc-per-node", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics, resets = killed / "metrics.jsonl", killed / "rollout" / "resets.log"
    deadline = time.monotonic() + hang_guard_s(600)
    worker_killed = rank_killed = False
    while time.monotonic() < deadline and proc.poll() is None:
        if not worker_killed and _lines(metrics) >= 2:
            os.kill(_pids(killed)[1][0], signal.SIGKILL)
            worker_killed = True
        elif worker_killed and resets.exists() and _lines(metrics) >= 6:
            generation, pids = _pids(killed)
            assert generation >= 1
            os.kill(_parent(pids[0]), signal.SIGKILL)  # the workers' parent: trainer rank 0
            rank_killed = True
            break
        time.sleep(0.005)
    assert rank_killed, "the run ended before the kills"
    assert proc.wait(timeout=hang_guard_s(120)) != 0
    again = _cli([str(path), "--run-dir", str(killed), *ARGS, "--json"], 2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["resumed_from"] >= 5
    assert _rows(killed) == _rows(straight) and len(_rows(killed)) == STEPS
    ids = [i for line in _samples(killed) for i in line["ids"]]
    assert sorted(ids) == list(range(STEPS * P * G))  # none lost, none twice
    assert _samples(killed) == _samples(straight)
    want = _policy(straight)
    assert all(torch.equal(_policy(killed)[k], want[k]) for k in want)
