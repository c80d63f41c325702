"""Shared fixtures for tests/observe: one real Prometheus server, and three real 2-rank
``aihpc train`` runs of examples/tiny-train.toml (an injected kill, hang and exception) that it
scrapes. The metrics, dashboard and doctor tests all read the same runs, so the area pays for
each run once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from promserver import TARGETS_ENV, URL_ENV, Prometheus, free_port, start

from hang_bounds import hang_guard_s, hang_timeout_s

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-train.toml"
TRAIN_STEPS, INTERVAL = 12, 4


def spec_text() -> str:
    """The example, shortened: 12 steps, a save every 4, every save kept (bytes are counted),
    saves synchronous: an async step-4 commit may still be in flight when the step-5/6 fault
    lands on a loaded machine, and resuming from 0 is then right, but the tests want a resume."""
    text = EXAMPLE.read_text()
    for old, new in (
        ("train_steps = 40", f"train_steps = {TRAIN_STEPS}"),
        ("interval_steps = 10", f"interval_steps = {INTERVAL}"),
        ("keep_last = 2", "keep_last = 10"),
        ("log_interval = 10", "log_interval = 4"),
        ("async_save = true", "async_save = false"),
    ):
        assert old in text, f"{EXAMPLE.name} changed: {old!r} not found"
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Prometheus:
    """.ci/run's server (AIHPC_PROMETHEUS_URL), else one started here from PATH."""
    url, targets = os.environ.get(URL_ENV), os.environ.get(TARGETS_ENV)
    if url and targets:
        prom = Prometheus(url, Path(targets))
        if not prom.ready():
            pytest.fail(f"{URL_ENV}={url} is set but Prometheus does not answer")
        yield prom
        return
    try:
        prom = start(tmp_path_factory.mktemp("prometheus"))
    except (FileNotFoundError, RuntimeError) as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run these tests against a real Prometheus: {err}")
        pytest.skip(f"no Prometheus here ({err}); .ci/run installs Debian's package")
    yield prom
    prom.stop()


@dataclass
class Run:
    name: str
    job: str
    dir: Path
    proc: subprocess.CompletedProcess
    begin: float
    end: float
    hang_timeout_s: float | None = None  # --hang-timeout, where the run set one

    @property
    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())

    def events(self, name: str) -> list[dict]:
        rows = [json.loads(x) for x in (self.dir / "events.jsonl").read_text().splitlines()]
        return [r for r in rows if r["event"] == name]

    @property
    def log(self) -> Path:
        """What the job printed (stdout then stderr), as a user would save it."""
        path = self.dir.parent / f"{self.name}.log"
        path.write_text(self.proc.stdout + self.proc.stderr)
        return path


def train(
    tmp: Path,
    name: str,
    prom: Prometheus | None,
    *extra: str,
    textfile: bool = False,
    opt_out: bool = False,
):
    """``aihpc train`` on 2 ranks with metrics; Prometheus scrapes it when given. ``opt_out``:
    ``[checkpoint] in_process_restarts = 0`` (an exception then ends the job)."""
    spec = tmp / "run.toml"
    spec.write_text(spec_text() + ("in_process_restarts = 0\n" if opt_out else ""))
    job = f"{name}-{uuid.uuid4().hex[:8]}"  # unique per test session: a shared server keeps data
    args = [sys.executable, "-m", "aihpc", "train", str(spec), "--run-dir", str(tmp / "run")]
    args += ["--nproc-per-node", "2", "--json", *extra]
    if prom is not None:
        port = free_port(2)
        prom.add_targets(job, [port, port + 1])
        args += ["--metrics-port", str(port)]
    if textfile:
        args += ["--metrics-textfile", str(tmp / "textfile")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AIHPC_JOB": job}
    begin = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=hang_guard_s(300))
    return Run(name, job, tmp / "run", proc, begin, time.time())


@pytest.fixture(scope="session")
def kill_run(tmp_path_factory, prometheus) -> Run:
    """Rank 1 SIGKILLed after step 6; the agent restarts both ranks once."""
    tmp = tmp_path_factory.mktemp("kill")
    run = train(tmp, "kill", prometheus, "--max-restarts", "1", "--inject", "kill:step=6:rank=1")
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def hang_run(tmp_path_factory, prometheus, kill_run) -> Run:
    """Rank 1 SIGSTOPped after step 5; rank 0's watchdog fires; one restart. The hang timeout
    is 3 s, or more where the kill run (the same spec, just before) shows this machine slower
    (tests/hang_bounds.py): a fixed 3 s fired during the restart's checkpoint load on a machine
    loaded 10-30 on 2 cores, and the run then had no restart left."""
    timeout_s = hang_timeout_s(kill_run.dir, floor_s=3.0)
    tmp = tmp_path_factory.mktemp("hang")
    run = train(
        tmp,
        "hang",
        prometheus,
        "--max-restarts",
        "1",
        "--hang-timeout",
        str(timeout_s),
        "--inject",
        "hang:step=5:rank=1",
    )
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    run.hang_timeout_s = timeout_s
    return run


@pytest.fixture(scope="session")
def exception_run(tmp_path_factory) -> Run:
    """Rank 1 raises after step 3, no restarts: the job fails. Metrics to a textfile only."""
    tmp = tmp_path_factory.mktemp("exception")
    # the failure, not its in-process recovery (on by default): opted out
    run = train(
        tmp, "exception", None, "--inject", "exception:step=3:rank=1", textfile=True, opt_out=True
    )
    assert run.proc.returncode == 1, run.proc.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def fr_run(tmp_path_factory) -> tuple[Path, str]:
    """Real flight-recorder dumps (gloo records since PyTorch 2.7): (dump folder, stderr)."""
    return _fr_job(tmp_path_factory, "missing")


@pytest.fixture(scope="session")
def fr_mismatch_run(tmp_path_factory) -> tuple[Path, str]:
    """Rank 0 broadcasts where rank 1 all-reduces: the dumps and stderr."""
    return _fr_job(tmp_path_factory, "mismatch")


@pytest.fixture(scope="session")
def detail_mismatch_run(tmp_path_factory) -> tuple[Path, str]:
    """The same under TORCH_DISTRIBUTED_DEBUG=DETAIL: ProcessGroupWrapper's own error."""
    return _fr_job(tmp_path_factory, "mismatch", TORCH_DISTRIBUTED_DEBUG="DETAIL")


def _fr_job(tmp_path_factory, mode: str, **env_extra: str) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp(f"flight_recorder_{mode}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "64", **env_extra}
    # --tee 3: each worker's lines prefixed "[default<local rank>]:", as users often run it
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--tee", "3"]
    args += ["--log-dir", str(out.parent / f"fr_logs_{out.name}")]
    args += ["--master-port", str(free_port()), str(Path(__file__).with_name("fr_worker.py"))]
    timeout = hang_guard_s(120)
    proc = subprocess.run(
        [*args, str(out), mode], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout + proc.stderr


RL_EXAMPLE = ROOT / "examples" / "rl" / "grpo_tiny_cpu.toml"
RL_STEPS = 16


@pytest.fixture(scope="session")
def rl_run(tmp_path_factory, prometheus) -> Run:
    """``aihpc rl train`` of examples/rl/grpo_tiny_cpu.toml (16 steps) with this host's copy
    of its spec beside it (``aihpc calibrate --local``'s form, so the predicted phases are
    exported), its metrics.prom served by node-exporter's textfile collector, which Prometheus
    scrapes: how a cluster reads an RL run's figures."""
    import runpy
    import shutil

    exporter = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if exporter is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must serve the RL run's textfile with node-exporter")
        pytest.skip("no node-exporter here; .ci/run installs Debian's prometheus-node-exporter")
    host = runpy.run_path(str(ROOT / "tests" / "runtime" / "local_host_spec.py"))["HOST_COPY"]
    tmp = tmp_path_factory.mktemp("rl")
    text = RL_EXAMPLE.read_text()
    for old, new in (("train_steps = 100", f"train_steps = {RL_STEPS}"),
                     ("interval_steps = 25", f"interval_steps = {RL_STEPS}")):  # fmt: skip
        assert old in text, f"{RL_EXAMPLE.name} changed: {old!r} not found"
        text = text.replace(old, new)
    (tmp / "rl.toml").write_text(text)
    (tmp / "rl.local.toml").write_text(host.format(n=1))
    run_dir = tmp / "run"
    run_dir.mkdir()
    port = free_port()
    textfile = [f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
                "--collector.textfile", f"--collector.textfile.directory={run_dir}"]  # fmt: skip
    node = subprocess.Popen([exporter, *textfile], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    job = f"rl-{uuid.uuid4().hex[:8]}"
    prometheus.add_targets(job, [port])
    # The GRPO steps take a second or two: start only once Prometheus scrapes the exporter, or
    # the file watcher's delay on a loaded host leaves the counters one sample and no rate.
    deadline = time.monotonic() + hang_guard_s(60)
    while prometheus.values(f'up{{test="{job}"}}').get("") != 1.0:
        assert time.monotonic() < deadline, f"Prometheus never scraped node-exporter on {port}"
        time.sleep(0.25)
    args = [sys.executable, "-m", "aihpc", "rl", "train", str(tmp / "rl.toml")]
    args += ["--run-dir", str(run_dir), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AIHPC_JOB": job}
    try:
        begin = time.time()
        proc = subprocess.run(args, capture_output=True, text=True, env=env,
                              timeout=hang_guard_s(300))  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        time.sleep(2.0)  # the last values scraped (every 0.5 s) before the range ends
        yield Run("rl", job, run_dir, proc, begin, time.time())
    finally:
        node.terminate()
        node.wait(timeout=10)
