"""The sbatch script `aihpc launch` writes, read as Slurm and bash would read it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from aihpc.interop.slurm import SlurmOptions, sbatch_script
from aihpc.runspec import SpecError, runspec_from_dict


def _spec(gpu: str = "h100-sxm", num_gpus: int = 1024, **cluster) -> object:
    dp = num_gpus // (8 * 4)  # a batch the derived dp divides (1,152 GB200s: dp 36)
    return runspec_from_dict(
        {
            "model": {"preset": "llama3-70b"},
            "cluster": {"gpu": gpu, "num_gpus": num_gpus, **cluster},
            "parallel": {"tp": 8, "pp": 4, "global_batch_size": 16 * dp},
        }
    )


def _directives(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=?(.*)$", script, re.M))


def test_nodes_tasks_and_rendezvous_from_the_plan(tmp_path: Path) -> None:
    spec = _spec()
    opts = SlurmOptions(
        run_dir=tmp_path, exclude=("gpu-[017,042]", "gpu-100"), time_limit="4:00:00"
    )
    script = sbatch_script(spec, Path("plan.toml"), opts)
    d = _directives(script)
    assert d["nodes"] == str(1024 // 8) and d["ntasks-per-node"] == "1"
    assert d["gpus-per-node"] == "8" and d["time"] == "4:00:00"
    assert d["requeue"] == "" and d["signal"] == "B:USR1@120"
    assert d["exclude"] == "gpu-[017,042],gpu-100"
    assert "--nproc-per-node=8" in script and "--rdzv-backend=c10d" in script
    assert '--rdzv-id="$SLURM_JOB_ID"' in script
    assert "export NCCL_IB_TIMEOUT=22" in script  # 128 nodes: the scale-out fabric
    assert "NCCL_MNNVL_ENABLE" not in script  # an HGX node is its own NVLink domain
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    # torchrun's agent whose stop on a signal ends in one line; it waits for the last checkpoint
    assert "-m aihpc.runtime.torchrun \\\n        --nnodes=" in script
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120 " in script
    # the time limit's SIGUSR1 reaches the ranks as SIGTERM through scancel, never through srun,
    # which would kill its tasks at once
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"\' USR1' in script
    assert "kill -TERM" not in script
    done = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr


def test_rack_scale_nvlink_and_refusals(tmp_path: Path) -> None:
    script = sbatch_script(_spec("gb200", 1152), Path("p.toml"), SlurmOptions(tmp_path))
    assert "export NCCL_MNNVL_ENABLE=1" in script
    with pytest.raises(SpecError) as err:
        sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path, exclude=("a;rm",)))
    assert err.value.field == "--exclude"
    with pytest.raises(SpecError) as err:
        sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path, signal_lead_s=0))
    assert err.value.field == "--signal-lead"


def test_export_and_launch_answer_in_json(tmp_path: Path) -> None:
    """`--json` for scripts: export gives the config text and what it did not carry, launch the
    script it wrote (the same text the files hold)."""
    import json

    from typer.testing import CliRunner

    from aihpc.cli import app

    root = Path(__file__).resolve().parents[2]
    spec = root / "examples" / "llama3-70b.toml"
    out = tmp_path / "llama.sh"
    r = CliRunner().invoke(app, ["export", str(spec), "--to", "megatron", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["framework"] == "megatron" and doc["output"] == str(out)
    assert doc["config"] == out.read_text() and "--tensor-model-parallel-size 8" in doc["config"]
    assert isinstance(doc["not_carried"], list)
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["launch", str(spec), "--slurm", "--run-dir", str(run), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc == {"script": str(run / "job.sbatch"), "run_dir": str(run), "job_id": None}
    assert _directives((run / "job.sbatch").read_text())["nodes"] == str(1024 // 8)
