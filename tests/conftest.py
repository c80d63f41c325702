"""Suite-wide: time spent per test file, printed at the end of the run (slowest first), so a
suite that grows slow shows which file to look at. Setup and teardown count (module fixtures
that start processes or daemons are where the time goes)."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

_FILE_SECONDS: dict[str, float] = defaultdict(float)
_SUITE_START = [time.monotonic()]


def pytest_sessionstart(session: pytest.Session) -> None:
    _SUITE_START[0] = time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    start = time.monotonic()
    yield
    _FILE_SECONDS[item.location[0]] += time.monotonic() - start


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _FILE_SECONDS:
        return
    total = time.monotonic() - _SUITE_START[0]
    terminalreporter.section("seconds per test file (slowest 20)")
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: kv[1], reverse=True)
    for path, seconds in ranked[:20]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:8.1f} s  whole session, collection included")
