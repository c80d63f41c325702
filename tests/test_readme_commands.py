"""The README's two commands and CI: .ci/run runs the README's command 2 as written, in a virtual
environment it makes first, and what the tests import from the environment is declared by the
extras that command installs (so a package this machine happens to have cannot hide a missing
install step)."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "interop"))
import frameworks  # noqa: E402  (tests/interop/frameworks.py: what its parsers need)


def readme_commands() -> dict[str, str]:
    """{"1": command 1, "2": command 2}: the first command line after each numbered comment of
    the README's first ```bash block."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("```bash\n") + len("```bash\n") :]
    block = block[: block.index("```")]
    out: dict[str, str] = {}
    number = None
    for line in block.splitlines():
        heading = re.match(r"# (\d)\. ", line)
        if heading:
            number = heading.group(1)
        elif line.strip() and not line.startswith("#") and number and number not in out:
            out[number] = line
    return out


def test_the_readme_starts_with_two_commands() -> None:
    commands = readme_commands()
    assert set(commands) == {"1", "2"}
    assert "aihpc estimate examples/" in commands["1"]
    assert "pytest" in commands["2"]


def test_ci_runs_the_readme_command_2_verbatim_in_a_fresh_venv() -> None:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    command = readme_commands()["2"]
    assert command in lines, ".ci/run must run the README's command 2 exactly as written"
    venv = next(i for i, line in enumerate(lines) if re.search(r"python3 -m venv \S+", line))
    active = next(i for i, line in enumerate(lines) if re.search(r"\. \S+/bin/activate", line))
    assert venv < active < lines.index(command), "the venv is made and activated before it runs"


def test_command_2_installs_torch_before_the_extras() -> None:
    """torch's CPU build first (pip then keeps it for the `torch>=2.7` extra instead of fetching
    a CUDA build), then aihpc with the extras the tests need."""
    command = readme_commands()["2"]
    torch = command.index("pip install torch==2.13.0")
    assert torch < command.index("pip install -e '.[torch,test]'")
    extras = _declared_extras()
    assert any(r.name == "torch" and r.specifier.contains("2.7") for r in extras["torch"])


def _declared_extras() -> dict[str, list[Requirement]]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {k: [Requirement(r) for r in v] for k, v in project["optional-dependencies"].items()}
    extras[""] = [Requirement(r) for r in project["dependencies"]]
    return extras


def _closure(requirements: list[Requirement]) -> set[str]:
    """Distributions (normalised names) these requirements pull in, transitively, as installed
    here; a declared requirement that is not installed fails the test."""
    seen: set[str] = set()
    todo = [(r, "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = _norm(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{req.name} is declared but not installed: run the README's command 2")
        for sub in map(Requirement, requires):
            todo += [(sub, "")] + [(sub, e) for e in req.extras]
    return seen


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_what_the_framework_parsers_import_is_declared() -> None:
    """Every module tests/interop/frameworks.py takes from the environment (it installs
    torchtitan and DeepSpeed without their dependencies) belongs to a distribution that aihpc's
    own requirements, with the torch and test extras, pull in: pydantic, for DeepSpeed's config
    parser, once came only from the CI machine's system Python."""
    extras = _declared_extras()
    wanted = _closure(extras[""] + extras["torch"] + extras["test"])
    owners = metadata.packages_distributions()
    missing = {
        module: owners.get(module, ["?"])
        for module in frameworks.FROM_ENVIRONMENT + frameworks.BUILD_NEEDS
        if not {_norm(d) for d in owners.get(module, [])} & wanted
    }
    assert not missing, f"declare these in pyproject.toml's test extra: {missing}"
