"""Inputs the fuzz benchmark (benchmarks/fuzz_inputs.py, issue 42) found a traceback or a hang
on, outside the framework importers: run specs and calibrations nested too deep, nccl-tests and
benchmark JSON of the wrong shape, CSVs too big, and `aihpc doctor` on events, dumps and folders
that are not what they seem. Bad input is one line and exit 2; a doctor input it cannot use is
reported and the rest read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from hang_bounds import hang_guard_s

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
NCCL_JSON = ROOT / "tests/bench/data/all_reduce_perf_8xH100_1node.json"
DEEP = "[" * 100_000 + "]" * 100_000


def _one_line(result, field: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    assert field in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("value", ["[" * 3000 + "]" * 3000, "{a=" * 3000 + "1" + "}" * 3000])
@pytest.mark.parametrize("command", ["estimate", "goodput", "search"])
def test_a_run_spec_nested_too_deep(command: str, value: str, tmp_path: Path) -> None:
    spec = (ROOT / "examples/tiny-4gpu.toml").read_text() + f"\n[zzz]\nx = {value}\n"
    (tmp_path / "run.toml").write_text(spec)
    _one_line(runner.invoke(app, [command, str(tmp_path / "run.toml")]), "RUNSPEC")


def test_a_calibration_integer_beyond_64_bits(tmp_path: Path) -> None:
    cal = (ROOT / "examples/calibration-h100.toml").read_text() + f"\nzz = {10**400}\n"
    (tmp_path / "cal.toml").write_text(cal)
    result = runner.invoke(app, ["validate", "--calibration", str(tmp_path / "cal.toml")])
    _one_line(result, "cluster.calibration")
    assert "zz is a 401-digit integer" in result.stderr


def test_a_calibration_nested_too_deep(tmp_path: Path) -> None:
    (tmp_path / "cal.toml").write_text("x = " + "[" * 3000 + "]" * 3000 + "\n")
    result = runner.invoke(app, ["validate", "--calibration", str(tmp_path / "cal.toml")])
    _one_line(result, "cluster.calibration")


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("config", "devices", "LOG"),
        ("config", 3, "LOG"),
        ("args", "all_reduce_perf", "LOG"),
        ("results", {"a": 1}, "INPUT"),
    ],
)
def test_nccl_tests_json_of_the_wrong_shape(
    key: str, value: object, field: str, tmp_path: Path
) -> None:
    doc = json.loads(NCCL_JSON.read_text())
    doc[key] = value
    (tmp_path / "all_reduce_perf.json").write_text(json.dumps(doc))
    result = runner.invoke(
        app, ["calibrate", str(tmp_path / "all_reduce_perf.json"), "-o", str(tmp_path / "c.toml")]
    )
    _one_line(result, field)
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.parametrize(
    "text",
    [
        '{"benchmark": "comm", "results": ' + DEEP + "}",
        '{"benchmark": "comm", "results": 7}',
        '{"benchmark": "comm", "results": [{"collective": ["x"], "tier": "scale_up", '
        '"num_ranks": 8, "size_bytes": 1024, "time_us": 10}]}',
        '{"benchmark": "moe", "calibration": 7}',
    ],
)
def test_bench_json_of_the_wrong_shape(text: str, tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text(text)
    result = runner.invoke(app, ["calibrate", str(tmp_path / "b.json"), "-o", str(tmp_path / "c")])
    _one_line(result, "b.json")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (DEEP, "--measured"),
        ('{"median": ["kill"]}', "--measured median"),
        ('{"median": {"hang": 3}}', "--measured median"),
    ],
)
def test_goodput_measured_of_the_wrong_shape(text: str, field: str, tmp_path: Path) -> None:
    (tmp_path / "m.json").write_text(text)
    args = ["goodput", str(ROOT / "examples/llama3-70b.toml"), "--strategy", "compare"]
    result = runner.invoke(app, [*args, "--measured", str(tmp_path / "m.json")])
    _one_line(result, field)


@pytest.mark.parametrize(("option", "field"), [("--runs", "runs CSV"), ("--memory", "memory CSV")])
def test_a_csv_too_big_is_refused_before_it_is_read(
    option: str, field: str, tmp_path: Path
) -> None:
    from aihpc.runspec.inputs import MAX_INPUT_BYTES

    big = tmp_path / "big.csv"
    with open(big, "wb") as f:
        f.truncate(MAX_INPUT_BYTES + 1)  # sparse: no disk spent
    _one_line(runner.invoke(app, ["validate", option, str(big)]), field)


# ---- doctor ----------------------------------------------------------------------------------


def _doctor(*args: str) -> subprocess.CompletedProcess:
    """`aihpc doctor` as a subprocess, so that what hung before fails at the guard."""
    return subprocess.run(
        [sys.executable, "-m", "aihpc", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "event",
    [
        {"event": "fault", "rank": 0, "world_size": 10**15, "time_unix": 1.0},
        {"event": "hang_detected", "rank": 10**15, "time_unix": 2.0},
        {"event": "fault", "rank": 0, "time_unix": "yesterday"},
        {"event": "hang_detected", "rank": 0, "killed_peers": ["x", 1], "time_unix": 1.0},
    ],
)
def test_doctor_events_with_odd_values(event: dict, tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    lines = [{"event": "process_start", "rank": 1, "time_unix": 0.5}, event, [1, 2]]
    events.write_text("\n".join(json.dumps(e) for e in lines) + "\n")
    r = _doctor(str(events), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["class"] in ("injected_fault", "hang")
    assert all(0 <= rank <= 1 for rank in doc["ranks_seen"])  # 10**15 is no rank


@pytest.mark.parametrize(
    "dump",
    [
        {"version": "2.10", "entries": "none"},
        {"version": "2.10", "entries": [1.5]},
        {"version": "2.10", "entries": [{"collective_seq_id": 1}], "pg_status": "x"},
        {"version": "2.10", "entries": [{"collective_seq_id": 1, "frames": 5}]},
    ],
)
def test_doctor_flight_recorder_dumps_of_the_wrong_shape(dump: dict, tmp_path: Path) -> None:
    (tmp_path / "nccl_trace_rank_0").write_text(json.dumps(dump))
    r = _doctor(str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # the dump is reported unreadable; nothing else to go on
    assert doc["class"] == "none" and doc["files_read"] == 1 and doc["stuck_collectives"] == []


def test_doctor_refuses_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "job.log"
    os.mkfifo(fifo)
    r = _doctor(str(fifo))
    assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_doctor_refuses_a_folder_of_too_many_files(tmp_path: Path) -> None:
    from aihpc.observe.logfiles import MAX_FOLDER_FILES

    for i in range(MAX_FOLDER_FILES + 1):
        (tmp_path / f"f{i}.log").touch()
    r = _doctor(str(tmp_path))
    assert r.returncode == 2 and f"more than {MAX_FOLDER_FILES:,} entries" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_a_run_spec_integer_beyond_64_bits(value: int, tmp_path: Path) -> None:
    spec = (ROOT / "examples/tiny-4gpu.toml").read_text()
    spec = spec.replace("[cluster]", f"[cluster]\nmemory_headroom_gib = {value}", 1)
    (tmp_path / "run.toml").write_text(spec)
    _one_line(runner.invoke(app, ["estimate", str(tmp_path / "run.toml")]), "memory_headroom_gib")


def test_doctor_reads_past_a_damaged_gzip(tmp_path: Path) -> None:
    import gzip

    data = gzip.compress(b"".join(b"step %d | loss 3.2\n" % i for i in range(5000)))
    # one flipped byte early in the deflate stream: zlib's error, not a bad gzip header
    (tmp_path / "a.log.gz").write_bytes(data[:20] + bytes([data[20] ^ 0xFF]) + data[21:])
    from aihpc.observe.doctor import diagnose

    log = ROOT / "tests/observe/corpus/cuda-oom/rank5.log"
    (tmp_path / "b.log").write_bytes(log.read_bytes())
    r = _doctor(str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # the damaged file is reported; the other one is read
    assert doc["class"] == diagnose([log]).cls != "none" and doc["files_read"] == 2


def test_doctor_reads_past_a_truncated_gzip(tmp_path: Path) -> None:
    import gzip

    data = gzip.compress(b"x" * 100_000 + b"\nstep 1 | loss 3.2\n")  # no line ends early
    (tmp_path / "a.log.gz").write_bytes(data[: len(data) // 2])  # the job was killed mid-write
    r = _doctor(str(tmp_path / "a.log.gz"), "--json")  # click said "Aborted!", exit 1
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(r.stdout)["files_read"] == 1


def test_doctor_prints_an_event_time_no_clock_can(tmp_path: Path) -> None:
    event = {"event": "fault", "rank": 0, "time_unix": 1e300, "kinds": ["kill"]}
    (tmp_path / "events.jsonl").write_text(json.dumps(event) + "\n")
    r = _doctor(str(tmp_path / "events.jsonl"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "first failure: rank 0" in r.stdout


LONG = "x" * 300  # longer than a file name may be (NAME_MAX 255): Path.exists() raised OSError


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["doctor", LONG], "LOG"),
        (["import", "deepspeed", "{ds}", "--model", LONG], "--model"),
        (["validate", "--runs", LONG], "--runs"),
        (["calibrate", "--runs", LONG, "-o", "{tmp}/c.toml"], "--runs"),
        (["calibrate", "{nccl}", "-o", "a/" * 2100 + "c.toml"], "--output"),
    ],
)
def test_a_path_the_system_cannot_look_up(args: list[str], field: str, tmp_path: Path) -> None:
    subs = {
        "{ds}": str(ROOT / "tests/interop/data/deepspeed_zero3.json"),
        "{nccl}": str(ROOT / "tests/bench/data/all_reduce_perf_8xH100_1node.txt"),
        "{tmp}": str(tmp_path),
    }
    args = [subs.get(a, a).replace("{tmp}", str(tmp_path)) for a in args]
    _one_line(runner.invoke(app, args), field)
