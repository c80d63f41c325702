"""Suite-wide: time spent per test file (setup, call and teardown; summed over workers under
pytest-xdist), printed at the end of the run, slowest first, so a suite that grows slow names the
file to look at (module fixtures that start processes or daemons are where the time goes).
Under pytest-xdist, whose progress dots name no file, a line is printed as each file finishes.

Order: files run longest first (file_seconds.json, seconds per file of an earlier full run, from
``AIHPC_TEST_SECONDS_OUT=tests/file_seconds.json``), so that pytest-xdist's workers, which take
files one at a time (``--dist loadfile``), do not end with one long file running alone while the
other worker idles. A file missing from the table runs after those in it, in collection order;
the table orders the run and decides nothing else.

Hang guard: pytest-timeout's bound (pyproject's ``timeout``, or a test's own ``timeout`` mark) is
sized for a machine that runs the suite alone. Each test's bound is stretched by the contention
measured as it starts (the 1-minute load average per core, when above 1): a test that takes T
alone takes about T x load / cores beside other work, and a fixed 300 s failed a legitimate test
on a 2-core machine loaded 10-30. A hung test still fails, at its stretched bound."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

from hang_bounds import load_stretch

_FILE_SECONDS: dict[str, float] = defaultdict(float)
_SUITE_START = [time.monotonic()]
_FILE_LEFT: dict[str, int] = {}
_CONFIG: list[pytest.Config] = []


_ORDER_FILE = Path(__file__).with_name("file_seconds.json")


_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_launcher_env():
    """A test that leaves rank variables behind makes every later test in its xdist worker look
    launched by torchrun (benches and `aihpc train` then see a world of one): fail that test."""
    before = {k: os.environ.get(k) for k in _LAUNCHER}
    yield
    after = {k: os.environ.get(k) for k in _LAUNCHER}
    leaked = {k: v for k, v in after.items() if v != before[k]}
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    assert not leaked, f"the test left launcher variables set: {leaked}"


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist would queue files by their number of tests; keep the order set below
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        seconds = json.loads(_ORDER_FILE.read_text())
    except (OSError, ValueError):
        return
    items.sort(key=lambda item: -float(seconds.get(item.nodeid.split("::", 1)[0], 0.0)))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # before pytest-timeout's own wrapper reads the bound: the closest mark wins
    stretch = load_stretch()
    if stretch > 1.0:
        mark = item.get_closest_marker("timeout")
        kwargs = dict(mark.kwargs) if mark is not None else {}
        base = mark.args[0] if mark is not None and mark.args else kwargs.pop("timeout", None)
        if base is None:
            base = item.config.getoption("timeout", None) or item.config.getini("timeout")
        if base and float(base) > 0:
            item.add_marker(pytest.mark.timeout(float(base) * stretch, **kwargs), append=False)
    return (yield)


def pytest_sessionstart(session: pytest.Session) -> None:
    _SUITE_START[0] = time.monotonic()
    _CONFIG.append(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    if _FILE_LEFT:  # every worker collects the same items
        return
    for nodeid in ids:
        path = nodeid.split("::", 1)[0]
        _FILE_LEFT[path] = _FILE_LEFT.get(path, 0) + 1


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # setup, call and teardown each report their duration; under pytest-xdist the reports
    # reach the controller, so the table covers every worker
    _FILE_SECONDS[report.location[0]] += report.duration
    path = report.nodeid.split("::", 1)[0]
    if report.when != "teardown" or path not in _FILE_LEFT:
        return
    _FILE_LEFT[path] -= 1
    if _FILE_LEFT[path] == 0:
        elapsed = time.monotonic() - _SUITE_START[0]
        reporter = _CONFIG[0].pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(
                f"[{elapsed / 60:5.1f} min] done {path} ({_FILE_SECONDS[path]:.1f} s)"
            )


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _FILE_SECONDS:
        return
    total = time.monotonic() - _SUITE_START[0]
    terminalreporter.section("seconds per test file (slowest 20)")
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: kv[1], reverse=True)
    for path, seconds in ranked[:20]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:8.1f} s  whole session, collection included")
    out = os.environ.get("AIHPC_TEST_SECONDS_OUT")
    if out:
        Path(out).write_text(json.dumps({k: round(v, 1) for k, v in ranked}, indent=1) + "\n")
