"""Joining a job started by torchrun or srun (real processes, localhost)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from aihpc.bench.dist import _first_slurm_host, free_port, launcher_env


def test_launcher_env_reads_torchrun_and_slurm():
    assert launcher_env({"PATH": "/bin"}) is None
    env = launcher_env({"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "n1", "MASTER_PORT": "7"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == (
        "3",
        "8",
        "0",
        "n1",
    )
    env = launcher_env(
        {
            "SLURM_PROCID": "9",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_NODELIST": "gpu[017-018],login1",
            "SLURM_JOB_ID": "4537",
        }
    )
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("9", "16", "1")
    assert env["MASTER_ADDR"] == "gpu017" and env["MASTER_PORT"] == str(4537 % 4536 + 61000)
    assert _first_slurm_host("node07") == "node07"
    assert _first_slurm_host("a[3,5-9]") == "a3"


def _json_rows(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{") :])


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_joins_torchrun():
    res = subprocess.run(
        [
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--no-python",
            "aihpc",
            "bench",
            "comm",
            "-C",
            "all_reduce,send_recv",
            "-b",
            "4K",
            "-e",
            "4K",
            "-n",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    doc = _json_rows(res.stdout)  # printed once, by rank 0
    assert res.stdout.count('"benchmark"') == 1
    assert doc["world_size"] == 2 and doc["wrong_rows"] == 0 and len(doc["results"]) == 2


def test_joins_srun_environment():
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": "1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "aihpc",
                    "bench",
                    "comm",
                    "-C",
                    "broadcast",
                    "-b",
                    "1K",
                    "-e",
                    "1K",
                    "-n",
                    "2",
                    "--json",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:]
    doc = _json_rows(outs[0][0])
    assert doc["world_size"] == 2 and doc["results"][0]["wrong"] == 0
    assert outs[1][0].strip() == ""  # only rank 0 prints
