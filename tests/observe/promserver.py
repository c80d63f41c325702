"""A real Prometheus server (Debian's ``prometheus`` package) for tests/observe.

``.ci/run`` starts one before the tests (``python3 tests/observe/promserver.py start DIR`` prints
the ``export`` lines); without it the tests start their own the same way. Targets come from
files the tests write into the targets folder (file-based service discovery), so one server
serves every test. Scrapes every 0.5 s: a test run lives a few seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

SCRAPE_INTERVAL = "500ms"
URL_ENV, TARGETS_ENV = "AIHPC_PROMETHEUS_URL", "AIHPC_PROMETHEUS_TARGETS"


def free_port(count: int = 1) -> int:
    """A port P with P .. P + count - 1 all free on this machine (aihpc's own choice: below the
    kernel's ephemeral range, where torchelastic's restart ports never land)."""
    from aihpc._net import free_port as pick

    return pick(count)


def config_text(targets_dir: Path) -> str:
    return (
        "global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL}\n"
        f"  scrape_timeout: {SCRAPE_INTERVAL}\n"
        "scrape_configs:\n"
        "  - job_name: aihpc\n"
        "    file_sd_configs:\n"
        f"      - files: ['{targets_dir}/*.json']\n"
    )


class Prometheus:
    """The HTTP API of a running server, and its targets folder."""

    def __init__(self, url: str, targets_dir: Path, proc: subprocess.Popen | None = None):
        self.url, self.targets_dir, self.proc = url.rstrip("/"), Path(targets_dir), proc

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def add_targets(self, name: str, ports: list[int]) -> None:
        doc = [{"targets": [f"127.0.0.1:{p}" for p in ports], "labels": {"test": name}}]
        tmp = self.targets_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.targets_dir / f"{name}.json")  # whole file or none for the watcher

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            doc = json.loads(r.read())
        if doc.get("status") != "success":
            raise RuntimeError(f"Prometheus: {doc}")
        return doc["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.api("query", **params)["result"]

    def values(self, expr: str, at: float | None = None) -> dict[str, float]:
        """``{rank: value}`` of an instant query (every series has a rank label)."""
        return {r["metric"].get("rank", ""): float(r["value"][1]) for r in self.query(expr, at)}

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start(workdir: Path, timeout_s: float = 30.0) -> Prometheus:
    """Start ``prometheus`` from PATH on a free localhost port; wait until it is ready."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise FileNotFoundError("prometheus is not installed (apt-get install -y prometheus)")
    workdir.mkdir(parents=True, exist_ok=True)
    targets = workdir / "targets"
    targets.mkdir(exist_ok=True)
    (workdir / "prometheus.yml").write_text(config_text(targets))
    port = free_port()
    log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 -- the server outlives this call
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # .ci/run's server outlives the Python that started it
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", targets, proc)
    deadline = time.monotonic() + timeout_s
    while not prom.ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            prom.stop()
            tail = (workdir / "prometheus.log").read_text()[-2000:]
            raise RuntimeError(f"prometheus did not become ready:\n{tail}")
        time.sleep(0.1)
    return prom


if __name__ == "__main__":
    # .ci/run: eval "$(python3 tests/observe/promserver.py start DIR)"
    if len(sys.argv) != 3 or sys.argv[1] != "start":
        sys.exit("usage: promserver.py start DIR")
    server = start(Path(sys.argv[2]).resolve())
    print(f"export {URL_ENV}={server.url}")
    print(f"export {TARGETS_ENV}={server.targets_dir}")
    print(f"export AIHPC_PROMETHEUS_PID={server.proc.pid if server.proc else ''}")
