"""Joinable, alertable metrics: dcgm-exporter's labels on every series, the docs' join queries
and the dashboard's GPU row evaluated by a real Prometheus that scrapes a dcgm-exporter-format
target beside real exporters, and the shipped alert rules run by promtool's rule unit tests and
evaluated against a killed and a cleanly closed exporter."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from promserver import free_port

from aihpc.observe.dashboards import load_dashboard, panel_queries, query_range, substitute
from aihpc.observe.dashboards.alerts import ALERTS, RULES_PATH, render
from aihpc.observe.gpu_labels import hostname, parse_gpus, resolve
from hang_bounds import hang_guard_s

ROOT = Path(__file__).resolve().parents[2]
HOST = hostname()
# nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader on an 8-GPU node (2 shown)
SMI = "0, GPU-8c16e996-bd76-aa91-17e7-b48bcd0208ba, NVIDIA H100 80GB HBM3\n" + (
    "1, GPU-72ad4d20-cfed-f08d-c894-f620962ca3e4, NVIDIA H100 80GB HBM3\n"
)
ALERT = {a.name: a for a in ALERTS}


# ---- gpu labels from nvidia-smi ----------------------------------------------------------------
def test_rank_gpu_found_through_cuda_visible_devices():
    rows = parse_gpus(SMI)
    assert [r[0] for r in rows] == ["0", "1"]
    assert resolve(1, rows, {})[:2] == (rows[1][0], rows[1][1])  # cuda:1 is NVML 1
    assert resolve(0, rows, {"CUDA_VISIBLE_DEVICES": "1"})[:2] == (rows[1][0], rows[1][1])
    assert resolve(0, rows, {"CUDA_VISIBLE_DEVICES": "GPU-72ad"})[:2] == rows[1][:2]  # a prefix
    assert resolve(1, rows, {"CUDA_VISIBLE_DEVICES": "1,0"})[:2] == rows[0][:2]


@pytest.mark.parametrize(
    "env",
    [
        {"CUDA_VISIBLE_DEVICES": "MIG-5c1a3e5e-4f3c-5e0f-9c8e-6b2f0d1e2a3b"},
        {"CUDA_VISIBLE_DEVICES": "GPU-"},  # matches both: CUDA would refuse it
        {"CUDA_VISIBLE_DEVICES": "7"},
        {"CUDA_VISIBLE_DEVICES": ""},
    ],
)
def test_a_gpu_not_told_for_sure_gets_no_label(env):
    gpu, uid, why = resolve(0, parse_gpus(SMI), env)
    assert (gpu, uid) == ("", "") and why


def test_mixed_models_need_pci_bus_order():
    last = SMI.splitlines()[1]
    mixed = SMI.replace(last, last.replace("H100 80GB HBM3", "A100-SXM4-40GB"))
    rows = parse_gpus(mixed)
    assert resolve(1, rows, {})[:2] == ("", "")
    assert resolve(1, rows, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})[:2] == rows[1][:2]


def test_gpu_labels_run_nvidia_smi_only_for_a_gpu_run(tmp_path, monkeypatch, caplog):
    from aihpc.observe.gpu_labels import NVIDIA_SMI_ARGS, gpu_labels

    env = {"NODE_NAME": "k8s-node-7"}  # dcgm-exporter's Hostname in Kubernetes
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert gpu_labels(0, on_gpu=False, env=env).labels() == {
        "gpu": "",
        "UUID": "",
        "Hostname": "k8s-node-7",
    }
    assert gpu_labels(0, on_gpu=True, env={}).labels()["UUID"] == ""
    assert "no nvidia-smi" in caplog.text
    # a node's nvidia-smi (this machine has none): prints its table for exactly our query
    tool = tmp_path / "nvidia-smi"
    want = " ".join(NVIDIA_SMI_ARGS[1:])
    tool.write_text(f'#!/bin/sh\n[ "$*" = "{want}" ] || exit 9\nprintf "%s" "{SMI}"\n')
    tool.chmod(0o755)
    rows = parse_gpus(SMI)
    got = gpu_labels(1, on_gpu=True, env={"CUDA_VISIBLE_DEVICES": "1,0"})
    assert (got.gpu, got.uuid, got.hostname) == (*rows[0][:2], socket.gethostname())


# ---- the shipped rules --------------------------------------------------------------------------
def _promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must check the rules with Debian's promtool (package prometheus)")
        pytest.skip("no promtool here; .ci/run installs Debian's prometheus package")
    return binary


def test_rules_file_is_the_generated_one_and_promtool_accepts_it():
    assert RULES_PATH.read_text() == render(), "python -m aihpc.observe.dashboards.alerts"
    proc = subprocess.run([_promtool(), "check", "rules", str(RULES_PATH)], capture_output=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(ALERTS)} rules found" in proc.stdout.decode()


def _series(job: str, finished: str, last_step: str, ranks=("0", "1")) -> list[dict]:
    out = []
    for rank in ranks:
        sel = f'{{hpc_job="{job}",rank="{rank}"}}'
        out.append({"series": f"aihpc_train_finished{sel}", "values": finished})
        out.append({"series": f"aihpc_train_last_step_timestamp_seconds{sel}", "values": last_step})
    return out


def _fires(alert: str, at: str, jobs: list[str]) -> dict:
    rule = ALERT[alert]
    exp = [
        {
            "exp_labels": {"hpc_job": j, "severity": rule.severity},
            "exp_annotations": {
                "summary": rule.summary.replace("{{ $labels.hpc_job }}", j),
                "description": rule.description,
            },
        }
        for j in jobs
    ]
    return {"eval_time": at, "alertname": alert, "exp_alerts": exp}


def test_promtool_rule_tests(tmp_path):
    """Series over time at Prometheus's 1-minute granularity; a vanished target is a stale
    marker, as Prometheus writes when a target goes. Minute m's step timestamp is 60 m."""
    series = [
        *_series("died", "0x10 stale", "0+60x10 stale"),  # killed after minute 10
        *_series("clean", "0x9 1 stale", "0+60x10 stale"),  # ended cleanly at 10
        *_series("clean-half", "0x9 1 stale", "0+60x10 stale", ranks=("0",)),
        *_series("clean-half", "0x10 stale", "0+60x10 stale", ranks=("1",)),  # missed last scrape
        *_series("restarted", "0x5 stale _ _ 0x80", "0+60x5 stale _ _ 480+60x80"),  # 3-min gap
        *_series("running", "0x90", "0+60x90"),
        *_series("hung", "0x90", "0+60x5 300x85"),  # last step at minute 5, still scraped
        *_series("textfile-done", "0x5 1x85", "0+60x5 300x85"),  # the file outlives the job
    ]
    tests = {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            _fires("AihpcJobDied", "13m", []),  # pending: 5 minutes of for
            _fires("AihpcJobDied", "8m", []),  # the restart gap stays under for
            _fires("AihpcJobDied", "17m", ["died"]),
            _fires("AihpcJobDied", "75m", []),  # an hour after the death it resolves
            _fires("AihpcJobStalled", "14m", []),  # 9 minutes since the hung job's last step
            _fires("AihpcJobStalled", "18m", ["hung"]),  # textfile-done finished: left alone
        ],
    }
    doc = {"rule_files": [str(RULES_PATH)], "evaluation_interval": "1m", "tests": [tests]}
    path = tmp_path / "aihpc-alerts.test.json"  # JSON is YAML
    path.write_text(json.dumps(doc))
    proc = subprocess.run([_promtool(), "test", "rules", str(path)], capture_output=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()


# ---- a real Prometheus: dcgm-exporter's format beside real exporters -------------------------
GPUS = (  # (Hostname, gpu, UUID): two GPUs on this host, one on another node
    (HOST, "0", "GPU-8c16e996-bd76-aa91-17e7-b48bcd0208ba"),
    (HOST, "1", "GPU-72ad4d20-cfed-f08d-c894-f620962ca3e4"),
    ("other-node", "0", "GPU-a8affe7e-7930-ae20-3fc6-4b0edf3ebbf3"),
)
DCGM_FIELDS = {  # field: value of GPU i (index into GPUS)
    "DCGM_FI_DEV_GPU_UTIL": (71, 42, 99),
    "DCGM_FI_DEV_FB_USED": (61234, 512, 70000),
    "DCGM_FI_DEV_POWER_USAGE": (350.5, 120.25, 690.0),
    "DCGM_FI_DEV_GPU_TEMP": (61, 40, 80),
    "DCGM_FI_DEV_XID_ERRORS": (0, 0, 79),
}


def dcgm_exposition() -> str:
    """dcgm-exporter's /metrics, its default labels in its order."""
    lines = []
    for field, values in DCGM_FIELDS.items():
        lines += [f"# HELP {field} {field}.", f"# TYPE {field} gauge"]
        for (host, gpu, uid), value in zip(GPUS, values, strict=True):
            labels = (
                f'gpu="{gpu}",UUID="{uid}",pci_bus_id="00000000:{7 + int(gpu):02X}:00.0",'
                f'device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",Hostname="{host}",'
                'DCGM_FI_DRIVER_VERSION="570.124.06"'
            )
            lines.append(f"{field}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


class _Dcgm(BaseHTTPRequestHandler):
    def do_GET(self):
        body = dcgm_exposition().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _wait(what: str, check, timeout_s: float):
    deadline = time.monotonic() + hang_guard_s(timeout_s)
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _worker(port: int, job: str, gpu: tuple[str, str, str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    host, index, uid = gpu
    args = [sys.executable, str(Path(__file__).with_name("exporter_worker.py"))]
    args += [str(port), job, index, uid, host]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture(scope="module")
def gpu_jobs(prometheus):
    """dcgm-exporter's format served beside two one-rank exporters with a GPU's labels: the
    ``clean`` job on GPU 0 of this host, the ``died`` job on GPU 1. Both are scraped live
    (``live``: a time then), then ``clean`` closes and ``died`` is SIGKILLed (``ended``)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Dcgm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tag = uuid.uuid4().hex[:8]
    jobs = {"clean": f"clean-{tag}", "died": f"died-{tag}"}
    prometheus.add_targets(f"dcgm-{tag}", [server.server_address[1]])
    dcgm = f'DCGM_FI_DEV_GPU_UTIL{{test="dcgm-{tag}",Hostname="{HOST}"}}'
    procs, begin = {}, time.time()
    try:
        for (name, job), gpu in zip(jobs.items(), GPUS[:2], strict=True):
            port = free_port()
            procs[name] = _worker(port, job, gpu)
            prometheus.add_targets(job, [port])
        every = f'{{hpc_job=~"{jobs["clean"]}|{jobs["died"]}"}}'

        def scraped():
            # three scrapes of each: a range query's points (every 0.5 s) fall among them
            mine = prometheus.query(f"count_over_time(aihpc_train_finished{every}[1m]) >= 3")
            theirs = prometheus.query(f"count_over_time({dcgm}[1m]) >= 3")
            return len(mine) == 2 and len(theirs) == 2

        _wait("both exporters and dcgm scraped", scraped, 60)
        live = time.time()
        procs["died"].send_signal(signal.SIGKILL)
        procs["clean"].stdin.write("close\n")
        procs["clean"].stdin.flush()
        assert procs["clean"].stdout.readline().strip() == "closed"
        _wait("stale", lambda: not prometheus.query(f"aihpc_train_finished{every}"), 60)
        yield {"jobs": jobs, "begin": begin, "live": live, "ended": time.time()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        server.shutdown()


def doc_join_queries() -> list[str]:
    """The PromQL block of docs/observability.md's join section, one query per comment line."""
    doc = (ROOT / "docs" / "observability.md").read_text()
    section = doc.split("## Joining dcgm-exporter's GPU series", 1)[1]
    block = re.search(r"```promql\n(.*?)```", section, re.S).group(1)
    queries = [q.strip() for q in re.split(r"^#.*$", block, flags=re.M)]
    return [" ".join(q.split()) for q in queries if q]


@pytest.mark.slow
def test_series_carry_dcgm_labels(prometheus, gpu_jobs):
    job = gpu_jobs["jobs"]["clean"]
    found = prometheus.query(f'aihpc_train_step{{hpc_job="{job}"}}', at=gpu_jobs["live"])
    assert [s["metric"] for s in found] == [
        {**s["metric"], "gpu": GPUS[0][1], "UUID": GPUS[0][2], "Hostname": HOST} for s in found
    ] and found


@pytest.mark.slow
def test_docs_join_queries_pick_each_ranks_gpu(prometheus, gpu_jobs):
    queries = doc_join_queries()
    assert len(queries) == 3
    at = gpu_jobs["live"]
    for name, gpu in zip(("clean", "died"), GPUS[:2], strict=True):
        job = gpu_jobs["jobs"][name]
        util_by_host_gpu, util_by_uuid, tokens_per_joule = (q.replace("JOB", job) for q in queries)
        for expr in (util_by_host_gpu, util_by_uuid):
            (row,) = prometheus.query(expr, at=at)  # one rank, its GPU only
            assert row["metric"]["hpc_job"] == job and row["metric"]["rank"] == "0"
            assert row["metric"]["UUID"] == gpu[2]
            assert float(row["value"][1]) == DCGM_FIELDS["DCGM_FI_DEV_GPU_UTIL"][GPUS.index(gpu)]
        (tps,) = prometheus.query(f'aihpc_train_tokens_per_second{{hpc_job="{job}"}}', at=at)
        (tpj,) = prometheus.query(tokens_per_joule, at=at)
        watts = DCGM_FIELDS["DCGM_FI_DEV_POWER_USAGE"][GPUS.index(gpu)]
        assert float(tpj["value"][1]) == pytest.approx(float(tps["value"][1]) / watts, rel=1e-12)


@pytest.mark.slow
def test_dashboard_gpu_row_returns_the_jobs_gpu_data(prometheus, gpu_jobs):
    from aihpc.observe.dashboards.build import DCGM_ROW, PANELS

    titles = {p.title for p in PANELS if p.row == DCGM_ROW}
    assert len(titles) >= 3
    job = gpu_jobs["jobs"]["clean"]
    start, end = gpu_jobs["begin"], gpu_jobs["live"]
    seen = set()
    for title, expr, _ in panel_queries(load_dashboard()):
        if title not in titles:
            continue
        seen.add(title)
        result = query_range(prometheus.url, substitute(expr, job, "4s"), start, end, 0.5)
        assert result, f"{title}: {expr} gave no data"
        if "DCGM_FI_DEV_GPU_UTIL" in expr:  # the job's GPU, not the other two
            assert {float(v) for s in result for _, v in s["values"]} == {71.0}
    assert seen == titles


@pytest.mark.slow
def test_dashboard_gpu_row_beside_cpu_ranks(prometheus, gpu_jobs):
    """Ranks with no GPU label (CPU runs) in the picked jobs while dcgm-exporter series exist:
    the GPU row's join has no series for them, where it used to fail the whole query (two
    ranks in the empty UUID group: "found duplicate series for the match group {}")."""
    from aihpc.observe.dashboards.build import DCGM_ROW, PANELS

    tag = uuid.uuid4().hex[:8]
    jobs = [f"cpu-a-{tag}", f"cpu-b-{tag}"]
    procs = []
    try:
        for job in jobs:
            port = free_port()
            procs.append(_worker(port, job, (HOST, "", "")))
            prometheus.add_targets(job, [port])
        every = f'{{hpc_job=~"{"|".join(jobs)}"}}'
        _wait(
            "the CPU ranks scraped",
            lambda: len(prometheus.query(f"aihpc_train_step{every}")) == 2,
            60,
        )
        assert prometheus.query("DCGM_FI_DEV_GPU_UTIL"), "the dcgm series must be live here"
        titles = {p.title for p in PANELS if p.row == DCGM_ROW}
        exprs = [
            e for t, e, _ in panel_queries(load_dashboard()) if t in titles and "on (UUID)" in e
        ]
        assert exprs
        for expr in exprs:
            assert prometheus.query(substitute(expr, "|".join(jobs), "4s")) == [], expr
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_died_alert_names_the_killed_job_not_the_closed_one(prometheus, gpu_jobs):
    jobs = gpu_jobs["jobs"]
    died = " ".join(ALERT["AihpcJobDied"].expr.split())
    firing = {r["metric"]["hpc_job"] for r in prometheus.query(died, at=gpu_jobs["ended"])}
    assert jobs["died"] in firing and jobs["clean"] not in firing
    live = {r["metric"]["hpc_job"] for r in prometheus.query(died, at=gpu_jobs["live"])}
    assert not live & set(jobs.values())  # while they ran, neither


@pytest.mark.slow
@pytest.mark.parametrize("which", ["kill_run", "hang_run"])
def test_real_runs_end_cleanly_for_the_alert(prometheus, request, which):
    """aihpc train runs that recovered and finished: the end marker was scraped at 1 on every
    rank, so the died alert leaves them alone; CPU runs carry the host name and no GPU label."""
    import tomllib

    from aihpc.runspec import runspec_from_dict
    from conftest import spec_text

    spec = runspec_from_dict(tomllib.loads(spec_text()))
    run = request.getfixturevalue(which)
    sel = f'{{hpc_job="{run.job}"}}'
    _wait("stale", lambda: not prometheus.query(f"aihpc_train_finished{sel}"), 60)
    now = time.time()
    assert prometheus.values(f"last_over_time(aihpc_train_finished{sel}[10m])", at=now) == {
        "0": 1.0,
        "1": 1.0,
    }
    died = " ".join(ALERT["AihpcJobDied"].expr.split())
    assert run.job not in {r["metric"]["hpc_job"] for r in prometheus.query(died, at=now)}
    info = prometheus.query(f"last_over_time(aihpc_train_info{sel}[10m])", at=now)
    for s in info:
        labels = s["metric"]
        assert labels["Hostname"] == socket.gethostname() == labels["node"]
        assert "gpu" not in labels and "UUID" not in labels  # empty: Prometheus drops them
        assert labels["spec_gpu"] == spec.cluster.gpu.id
    assert len(info) == 2


def test_cli_writes_the_rules_file(tmp_path):
    from typer.testing import CliRunner

    from aihpc.cli import app

    runner = CliRunner()
    out = tmp_path / "aihpc-alerts.yml"
    res = runner.invoke(app, ["dashboard", "--alerts", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_text() == RULES_PATH.read_text()
    res = runner.invoke(app, ["dashboard", "--alerts", str(tmp_path / "missing" / "a.yml")])
    assert res.exit_code == 2 and "--alerts" in res.stderr and len(res.stderr.splitlines()) == 1
