"""Safe by default: a rank's Prometheus endpoint listens on the loopback interface unless
``--metrics-host`` opens it, and the agent passes the choice on to its workers."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from aihpc.cli.observe import metrics_args, metrics_config
from aihpc.observe.metrics import MetricsConfig, TrainMetrics
from aihpc.runspec import SpecError

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    from aihpc._net import free_port

    return free_port()


def _outside_address() -> str | None:
    """An IPv4 address of this host that is not loopback (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


def _connects(addr: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(10)
        try:
            s.connect((addr, port))
        except OSError:
            return False
    return True


def _serve(config: MetricsConfig) -> TrainMetrics:
    return TrainMetrics(config, job="host-test", rank=0)


def test_endpoint_listens_on_loopback_by_default():
    port = _free_port()
    m = _serve(MetricsConfig(port=port))
    try:
        assert m._server.socket.getsockname()[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            assert b"aihpc_train_restarts_total" in r.read()
        outside = _outside_address()
        if outside is not None:  # another interface of this host: refused
            assert not _connects(outside, port)
    finally:
        m.close(final=False)


def test_metrics_host_opens_what_it_names():
    outside = _outside_address()
    for host in ("0.0.0.0", *([outside] if outside else [])):
        port = _free_port()
        m = _serve(MetricsConfig(port=port, addr=host))
        try:
            assert m._server.socket.getsockname()[0] == host
            if outside is not None:
                assert _connects(outside, port)
        finally:
            m.close(final=False)


def test_train_options_default_to_loopback_and_reach_the_workers(tmp_path):
    port = _free_port()
    config = metrics_config(port, None, 1)
    assert config is not None and config.addr == "127.0.0.1"
    args = metrics_args(config)
    assert args[args.index("--metrics-host") + 1] == "127.0.0.1"
    opened = metrics_config(port, None, 1, "0.0.0.0")
    assert opened is not None and opened.addr == "0.0.0.0"
    args = metrics_args(opened)  # the elastic agent's workers listen where the user said
    assert args[args.index("--metrics-host") + 1] == "0.0.0.0"
    for bad in ("no such host.invalid", "127.0.0.1\nx", "", "192.0.2.254"):
        with pytest.raises(SpecError) as err:
            metrics_config(port, None, 1, bad)
        assert err.value.field == "--metrics-host"


def test_bad_metrics_host_exits_2_with_one_line(tmp_path):
    spec = ROOT / "examples" / "tiny-train.toml"
    cmd = [sys.executable, "-m", "aihpc", "train", str(spec), "--run-dir", str(tmp_path / "r")]
    cmd += ["--metrics-port", str(_free_port()), "--metrics-host", "not-a-host.invalid"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--metrics-host" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing started, nothing half-written
