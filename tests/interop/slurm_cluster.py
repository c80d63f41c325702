"""A real one-node Slurm cluster on this machine for tests: munged, slurmctld and slurmd from
Debian's slurm-wlm, configured in a scratch folder with this machine's CPUs, on free ports.

``python tests/interop/slurm_cluster.py start DIR`` prints ``export SLURM_CONF=...`` lines;
``stop DIR`` ends the daemons it started (by their pid files).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("slurmd", "slurmctld", "munged")


def available() -> str | None:
    """None when the daemons can be started here, else why not."""
    for exe in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol"):
        if shutil.which(exe) is None:
            return f"{exe} not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd needs root here (SlurmdUser=root)"
    return None


def free_port() -> int:
    from aihpc._net import free_port as pick

    return pick()


def _conf(d: Path, cpus: int, mem_mb: int) -> str:
    ctld, slurmd = free_port(), free_port()
    return f"""ClusterName=aihpctest
SlurmctldHost=localhost
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld}
SlurmdPort={slurmd}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=60
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def start(d: Path) -> dict[str, str]:
    """Start the daemons with their files under ``d``; the environment that points at them."""
    for sub in ("spool", "state", "log", "run", "munge"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "munge").chmod(0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    cpus = os.cpu_count() or 1
    mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    conf = d / "slurm.conf"
    conf.write_text(_conf(d, cpus, mem_mb))
    m = d / "munge"
    subprocess.run(
        ["munged", f"--socket={m}/munge.socket", f"--key-file={key}", f"--pid-file={m}/munged.pid",
         f"--log-file={m}/munged.log", f"--seed-file={m}/seed", "--force"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env, timeout=30)
    subprocess.run(["slurmd", "-f", str(conf), "-N", "localhost"], check=True, env=env, timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30
        ).stdout.strip()
        if out in ("idle", "mixed", "allocated"):
            return {"SLURM_CONF": str(conf)}
        time.sleep(0.5)
    stop(d)
    log = (d / "log" / "slurmctld.log").read_text(errors="replace")[-2000:]
    raise RuntimeError(f"slurm node did not come up: {out!r}\n{log}")


def stop(d: Path) -> None:
    pids = {
        "slurmd": d / "run" / "slurmd.pid",
        "slurmctld": d / "run" / "slurmctld.pid",
        "munged": d / "munge" / "munged.pid",
    }
    for name in DAEMONS:
        try:
            pid = int(pids[name].read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)


if __name__ == "__main__":
    command, folder = sys.argv[1], Path(sys.argv[2])
    if command == "start":
        for k, v in start(folder).items():
            print(f"export {k}={v}")
    else:
        stop(folder)
