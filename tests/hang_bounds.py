"""Hang bounds that hold on a loaded machine: a drill's hang timeout from the work a run of the
same spec did here, and the suite's hang guards (subprocess timeouts, pytest-timeout's bound)
stretched by the contention measured as they start.

A drill stalls one rank and checks that the watchdog finds it. Its ``--hang-timeout`` also bounds
every other phase of the run (docs/resilience.md, "Hangs"), so a timeout of a few seconds that is
far above a step on an idle machine fires during a legitimate checkpoint load or save on one
loaded 10-30 on 2 cores, and the drill then finds the wrong phase or runs out of restarts. The
timeout is the drill's own floor, or four times the slowest such phase of a run just before
(four times, as the trainer allows four times a transfer's expected time), whichever is larger.
"""

from __future__ import annotations

import json
import math
import os
from itertools import pairwise
from pathlib import Path


def load_stretch() -> float:
    """How many times slower than alone work runs here now: the 1-minute load average per core,
    at least 1 (a test that takes T alone takes about T x load / cores beside other work)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def hang_guard_s(seconds: float) -> float:
    """A hang guard sized for a machine that runs the suite alone (a subprocess's timeout),
    stretched by the contention measured now: on a 2-core machine loaded 10-30 a run that takes
    a minute alone takes ten, and a hung one still fails, at the stretched bound."""
    return seconds * load_stretch()


def _events(run_dir: Path, name: str) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == name]


def slowest_watched_phase_s(run_dir: Path) -> float:
    """The longest the run in ``run_dir`` went without progress in a phase its hang timeout
    bounds: from one step to the next of one attempt (a save and the logs included), a checkpoint
    load on any rank, the final commit. Start-up and each attempt's first step are bounded by
    --startup-timeout instead, and are left out."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = {e["step"] for e in _events(run_dir, "first_step")}
    spans = [b["end_unix"] - a["end_unix"] for a, b in pairwise(rows) if b["step"] not in first]
    ready = {(e["rank"], e["attempt"]): e["time_unix"] for e in _events(run_dir, "pg_ready")}
    loaded = _events(run_dir, "loaded")
    spans += [e["time_unix"] - ready[e["rank"], e["attempt"]] for e in loaded]
    spans.append(max(e["time_unix"] for e in _events(run_dir, "done")) - rows[-1]["end_unix"])
    return max(spans)


def hang_timeout_s(measured_run_dir: Path, floor_s: float) -> float:
    """``floor_s``, or four times the slowest watched phase of the measured run, rounded up to
    0.1 s (the watchdog logs its bound to 0.1 s)."""
    return max(floor_s, math.ceil(40 * slowest_watched_phase_s(measured_run_dir)) / 10)
