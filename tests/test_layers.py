"""The import rule of docs/architecture.md, from the imports themselves: every ``import`` in
src/aihpc (at module level, inside functions and under TYPE_CHECKING) goes to the importing
package itself or to a package its row of the table names; no import circle between modules;
the planner's packages never import torch; every module under 500 lines."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "aihpc"


def _rule_table() -> tuple[dict[str, set[str]], set[str]]:
    """({package: packages it may import}, packages that never import torch) from the doc."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## The import rule") : text.index("## Inside perf")]
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            allowed[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    never = re.search(r"Never torch: (.*)\.", section)
    assert never, "docs/architecture.md must name the packages that never import torch"
    return allowed, set(re.findall(r"`([^`]+)`", never.group(1)))


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ["aihpc", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(module: str) -> str:
    """The layer a module belongs to: aihpc.<package>..., the root package, or a helper."""
    parts = module.split(".")
    return "aihpc" if len(parts) == 1 else parts[1]


def _imports(module: str, text: str | None = None) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import of ``module`` (its file, or ``text``);
    ``from pkg import name`` counts as importing pkg.name when that is a module, else pkg."""
    path = MODULES.get(module)
    is_init = path is not None and path.name == "__init__.py"
    here = module.split(".") if is_init else module.split(".")[:-1]
    for node in ast.walk(ast.parse(text if text is not None else path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in MODULES else base), node.lineno


def test_the_rule_table_names_every_package() -> None:
    allowed, _ = _rule_table()
    packages = {_package(m) for m in MODULES}
    assert packages == set(allowed), (
        f"packages without a row or rows without a package: {packages ^ set(allowed)}"
    )


def _against_the_rule(module: str, text: str | None = None) -> list[str]:
    allowed, _ = _rule_table()
    mine = _package(module)
    return [
        f"{module}:{line} {mine} -> {target}"
        for target, line in _imports(module, text)
        if target.startswith("aihpc")
        and _package(target) != mine
        and _package(target) not in allowed[mine]
    ]


def test_no_package_imports_one_its_row_does_not_name() -> None:
    wrong = [line for module in MODULES for line in _against_the_rule(module)]
    assert not wrong, "imports against docs/architecture.md's rule:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_between_modules() -> None:
    """Package __init__ files only gather their modules' names, so they are left out: a circle
    is between modules that need each other's code."""
    modules = {m for m, p in MODULES.items() if p.name != "__init__.py"}
    graph = {m: {t for t, _ in _imports(m) if t in modules and t != m} for m in modules}
    assert not _cycles(graph)


def test_no_circles_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        mine = _package(module)
        graph.setdefault(mine, set()).update(
            _package(t)
            for t, _ in _imports(module)
            if t.startswith("aihpc") and _package(t) != mine
        )
    assert not _cycles(graph)


@pytest.mark.parametrize("package", sorted(_rule_table()[1]))
def test_planner_packages_never_import_torch(package: str) -> None:
    found = [
        f"{MODULES[m].relative_to(ROOT)}:{line}"
        for m in MODULES
        if _package(m) == package
        for target, line in _imports(m)
        if target == "torch" or target.startswith("torch.")
    ]
    assert not found, f"{package} imports torch: {found}"


def test_every_module_is_under_500_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) >= 500
    }
    assert not long, f"split these by concern: {long}"


def test_the_check_finds_an_import_against_the_rule() -> None:
    """The same check on a planner module that would import the trainer lazily, under
    TYPE_CHECKING and relatively: each is reported; importing down a layer is not."""
    text = (
        "from typing import TYPE_CHECKING\n"
        "from aihpc.runspec import RunSpec\n"
        "if TYPE_CHECKING:\n    from aihpc.runtime.train import TrainOptions\n"
        "def f():\n    import aihpc.runtime.model\n    from ...goodput import ettr\n"
    )
    found = _against_the_rule("aihpc.perf.step.example", text)
    assert [f.split(" -> ")[1] for f in found] == [
        "aihpc.runtime.train",
        "aihpc.runtime.model",
        "aihpc.goodput.ettr",
    ]


def _perf_table() -> dict[str, set[str]]:
    """{perf sub-package: sub-packages it may import} from the doc's "Inside perf" table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    allowed: dict[str, set[str]] = {}
    for line in text[text.index("## Inside perf") :].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            allowed[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    return allowed


def _perf_part(module: str) -> str:
    parts = module.split(".")
    return "perf" if len(parts) == 2 else parts[2]


def test_perf_sub_packages_import_only_their_row() -> None:
    """step/ prices training and is priced by the others; it never imports search, fit or
    infer, and infer (inference, RL rollout) builds on step only."""
    allowed = _perf_table()
    perf = {m for m in MODULES if m.startswith("aihpc.perf")}
    parts = {_perf_part(m) for m in perf}
    assert parts == set(allowed), (
        f"perf parts without a row or rows without one: {parts ^ set(allowed)}"
    )
    bad = [
        f"{m}:{line} imports {t}"
        for m in sorted(perf)
        for t, line in _imports(m)
        if t.startswith("aihpc.perf.")
        and _perf_part(t) != _perf_part(m)
        and _perf_part(t) not in allowed[_perf_part(m)]
    ]
    assert not bad, "\n".join(bad)
