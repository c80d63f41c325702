"""benchmarks/fuzz_inputs.py, a seeded slice: no traceback and no run past the limit on 132
generated inputs (12 of each family), the cases the same for the same seed, and the in-process
verdict the one `python -m aihpc` gives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_inputs.py"


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import fuzz_inputs
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return fuzz_inputs


def test_cases_are_seeded_and_cover_every_family() -> None:
    fz = _script()
    a, b = fz.make_cases(7, 44), fz.make_cases(7, 44)
    assert [(c.argv, c.files) for c in a] == [(c.argv, c.files) for c in b]
    assert [c.files for c in fz.make_cases(8, 44)] != [c.files for c in a]
    assert {c.family for c in a} == set(fz.FAMILIES)


@pytest.mark.slow
def test_a_seeded_slice_leaves_no_traceback() -> None:
    fz = _script()
    cases = fz.make_cases(20261207, 12 * len(fz.FAMILIES))
    # every 33rd case again as `python -m aihpc`: the verdicts must agree
    rows = fz.run_cases(cases, "inprocess", fz.LIMIT_S, verify_every=33)
    summary = fz.summarize(rows)
    assert summary["cases"] == len(cases)
    assert summary["tracebacks"] == 0 and summary["over_limit"] == 0, summary["failures"]
    assert summary["verified_as_subprocess"] == 4
    assert summary["verdicts_differing"] == 0, summary["differing"]
    # the slice reaches past the argument parser: refusals and answers both
    codes = {code for fam in summary["exit_codes_by_family"].values() for code in fam}
    assert {"0", "2"} <= codes


def test_a_traceback_is_seen_in_process_as_a_subprocess_sees_it(tmp_path: Path) -> None:
    """The verdict's three signs: an exception escaping main, 'Traceback' on stderr, an exit
    code other than 0, 1, 2; and a clean refusal is none of them."""
    fz = _script()
    assert fz._verdict(2, "error: x = 1: bad", False, 0.1) == "ok"
    assert fz._verdict(1, "", True, 0.1) == "traceback"
    assert fz._verdict(1, "Traceback (most recent call last):\n", False, 0.1) == "traceback"
    assert fz._verdict(-9, "", False, 0.1) == "traceback"
    assert fz._verdict(1, "Aborted!\n", False, 0.1) == "traceback"  # click's, for an EOFError
    assert fz._verdict(None, "", False, 61.0) == "timeout"
    rc, err, raised = fz.run_inprocess(["estimate", str(tmp_path / "missing.toml")])
    assert (rc, raised) == (2, False) and "missing.toml" in err
