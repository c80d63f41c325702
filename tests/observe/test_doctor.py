"""``aihpc doctor`` on a corpus of log excerpts in the tools' exact formats (cases.toml says what
each must yield), on the logs of real 2-rank ``aihpc train`` runs with an injected kill, hang
and exception, and on real flight-recorder dumps."""

from __future__ import annotations

import gzip
import json
import pickle
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.observe.doctor import diagnose
from aihpc.observe.flight_recorder import read_dump
from aihpc.observe.signatures import SIGNATURES
from aihpc.runspec import load_runspec

CORPUS = Path(__file__).with_name("corpus")
CASES = tomllib.loads((CORPUS / "cases.toml").read_text())
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(CASES))
def test_corpus_case(name):
    case = CASES[name]
    d = diagnose([CORPUS / name])
    assert d.cls == case["class"], d.summary
    if "rank" in case:
        assert d.cause.rank == case["rank"], d.summary
    if "node" in case:
        assert d.cause.node == case["node"], d.summary
    if case.get("not_joined") == "unknown":
        assert d.not_joined == [] and d.not_joined_state == "unknown", d.summary
        assert "not joined: unknown" in d.summary or d.frozen, d.summary
    elif "not_joined" in case:
        assert d.not_joined == case["not_joined"], d.summary
    if "not_joined_state" in case:
        assert d.not_joined_state == case["not_joined_state"], d.summary
    assert d.frozen == case.get("frozen", False)
    for text in case.get("summary_has", []):
        assert text in d.summary, d.summary
    for text in case.get("action_has", []):
        assert text in d.action, d.action
    followers = {row["rank"] for row in d.follow_on}
    assert set(case.get("follow_on", [])) <= followers, d.follow_on
    named = case.get("not_joined") if isinstance(case.get("not_joined"), list) else []
    assert d.cls == "hang" or d.cause is None or d.cause.rank not in named
    assert_claims_quoted(d)


def assert_claims_quoted(d):
    """Every claim comes with the line that supports it, quoted as the file holds it."""
    for ev in d.evidence:
        if ev["line"]:
            lines = Path(ev["file"]).read_text().splitlines()
            assert lines[ev["line"] - 1].strip()[:400] == ev["text"], ev
        else:  # from a flight-recorder dump: the dump is named
            assert Path(ev["file"]).is_file(), ev
    claims = " | ".join(ev["claim"] for ev in d.evidence)
    if d.cause is not None:
        assert d.evidence, d.summary
    for r in d.not_joined:
        assert f"rank {r} had not joined" in claims, (r, claims)


def test_every_case_folder_has_expectations():
    folders = {p.name for p in CORPUS.iterdir() if p.is_dir()}
    assert folders == set(CASES)


def test_oom_is_set_against_the_plans_estimated_memory():
    spec = load_runspec(ROOT / "examples" / "llama3-70b.toml")
    d = diagnose([CORPUS / "cuda-oom"], spec)
    assert "aihpc estimate prices this plan at" in d.action
    assert "against 79.1 GiB" in d.action  # the GPU's capacity from the allocator's message
    from aihpc.perf.step import estimate

    total = estimate(spec).memory.gib()["total"]
    assert f"{total:.1f} GiB per GPU" in d.action


def test_gzipped_logs_and_folders_are_read(tmp_path):
    text = (CORPUS / "ib-retry-exceeded" / "nccl-debug.log").read_bytes()
    with gzip.open(tmp_path / "nccl-debug.log.gz", "wb") as f:
        f.write(text)
    assert diagnose([tmp_path]).cls == "ib_error"


def test_no_failure_is_said_plainly(tmp_path):
    log = tmp_path / "ok.log"
    log.write_text("step 1 | loss 3.2\nstep 2 | loss 3.1\ntrained 2 steps on 2 rank(s)\n")
    d = diagnose([log])
    assert d.cls == "none" and d.cause is None and "no failure" in d.summary


def test_cli_json_and_one_line_errors(tmp_path):
    result = CliRunner().invoke(app, ["doctor", str(CORPUS / "xid-79"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["class"] == "xid" and doc["first_failure"]["details"]["xid"] == 79
    assert doc["first_failure"]["node"] == "gpu-b03"
    missing = CliRunner().invoke(app, ["doctor", str(tmp_path / "nope.log")])
    assert missing.exit_code == 2 and "nope.log" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_docs_table_names_every_class_and_source():
    doc = (ROOT / "docs" / "doctor.md").read_text()
    for sig in SIGNATURES:
        assert f"`{sig.cls}`" in doc, sig.cls


def test_a_pickled_dump_cannot_run_code(tmp_path):
    evil = tmp_path / "fr_trace_rank_0"
    evil.write_bytes(pickle.dumps({"entries": [], "version": "2.10", "x": Path("/")}))
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        read_dump(evil)
    d = diagnose([tmp_path])  # in a folder: reported unreadable, the rest still read
    assert d.cls == "none"


# ---- logs of real runs ---------------------------------------------------------------------


@pytest.mark.slow
def test_real_kill_is_found_on_the_killed_rank(kill_run):
    d = diagnose([kill_run.log])
    assert d.cls == "killed" and d.cause.rank == 1, d.summary
    assert d.recovered  # the elastic agent restarted it and the run finished
    # what rank 0 printed depends on timing (a closed-peer error, or only the agent's SIGTERM)
    assert d.follow_on and all(row["rank"] != 1 for row in d.follow_on)
    # the whole run directory: events.jsonl read, checkpoint shards and DCP metadata skipped
    drill = diagnose([kill_run.log, kill_run.dir])
    assert drill.cls == "injected_fault" and drill.cause.rank == 1
    assert drill.cause.details["kinds"] == ["kill"] and drill.cause.details["step"] == 6


@pytest.mark.slow
def test_real_hang_names_the_silent_rank(hang_run):
    d = diagnose([hang_run.log])
    assert d.cls == "hang" and d.cause.rank == 0, d.summary  # rank 0's watchdog saw it
    # the log alone shows rank 1 silent, which proves nothing (it is named to look at); the run
    # directory's events.jsonl says what happened to rank 1
    assert d.not_joined == [] and d.not_joined_state == "unknown" and 1 in d.silent, d.summary
    assert d.recovered
    with_events = diagnose([hang_run.log, hang_run.dir])
    assert with_events.cls == "injected_fault" and with_events.cause.rank == 1
    assert d.cause.details["step"] == 5 and d.cause.details["bound_s"] == hang_run.hang_timeout_s


@pytest.mark.slow
def test_real_exception_is_the_cause_not_the_peer_errors(exception_run):
    d = diagnose([exception_run.log])
    assert d.cls == "exception" and d.cause.rank == 1, d.summary
    assert "injected exception after step 3 on rank 1" in d.summary
    # what followed: rank 0's lost-peer error, or (when the agent stops it first) the agent's
    # SIGTERM to it; either way nothing of rank 1's is counted as a consequence
    assert d.follow_on and {row["rank"] for row in d.follow_on} <= {0, None}
    assert not d.recovered


@pytest.mark.slow
def test_real_flight_recorder_dumps_name_the_rank_that_never_joined(fr_run, tmp_path):
    dumps, stderr = fr_run
    (tmp_path / "stderr.log").write_text(stderr)
    d = diagnose([dumps, tmp_path / "stderr.log"])
    assert [(s.op, s.seq, s.entered, s.missing) for s in d.stuck] == [
        ("gloo:all_reduce", 4, (0,), (1,))
    ]
    assert d.stuck[0].frame.startswith("fr_worker.py:")
    assert d.cls == "collective_timeout" and d.cause.rank == 0
    assert d.not_joined == [1]


@pytest.mark.slow
def test_real_mismatched_collectives_are_a_program_bug(fr_mismatch_run, tmp_path):
    """Rank 0 broadcasts where rank 1 all-reduces: both time out, and the dumps' records of #4
    differ. The doctor says mismatch (no node to drain), not a network fault."""
    dumps, stderr = fr_mismatch_run
    (tmp_path / "stderr.log").write_text(stderr)
    d = diagnose([dumps, tmp_path / "stderr.log"])
    assert d.cls == "collective_mismatch", d.summary
    assert "gloo:broadcast" in d.summary and "gloo:all_reduce" in d.summary
    assert "scontrol" not in d.action and "program bug" in d.action
    assert {Path(ev["file"]).name for ev in d.evidence} == {"fr_trace_rank_0", "fr_trace_rank_1"}


@pytest.mark.slow
def test_real_detail_mismatch_error_is_a_program_bug(detail_mismatch_run, tmp_path):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: ProcessGroupWrapper's error as PyTorch prints it."""
    _, stderr = detail_mismatch_run
    assert "Detected mismatch between collectives on ranks" in stderr
    (tmp_path / "stderr.log").write_text(stderr)
    d = diagnose([tmp_path / "stderr.log"])
    assert d.cls == "collective_mismatch", d.summary
    assert "BROADCAST" in d.summary and "ALLREDUCE" in d.summary
    assert_claims_quoted(d)
