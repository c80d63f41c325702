"""Release 0.1's import paths keep working for one release (docs/architecture.md, "Old import
paths"): each imports with a DeprecationWarning naming the new path and gives the same objects."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from aihpc._moved import MOVED


def _fresh(name: str) -> object:
    """Import the old path ``name`` anew (an earlier test may have imported it), expecting the
    warning."""
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    with pytest.warns(DeprecationWarning, match=MOVED[name][0].replace(".", r"\.")):
        return importlib.import_module(name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_every_public_name_of_its_new_module(old: str) -> None:
    alias = _fresh(old)
    new = importlib.import_module(MOVED[old][0])
    names = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
    assert names
    for name in names:
        assert getattr(alias, name) is getattr(new, name), f"{old}.{name}"


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("aihpc.perf.memory", "memory_breakdown", "aihpc.perf.step.batch_memory"),
        ("aihpc.perf.compute", "gemm_efficiency", "aihpc.perf.step.gemm"),
        ("aihpc.perf.compute", "routed_expert_gemms", "aihpc.perf.step.moe_kernels"),
        ("aihpc.perf.goodput", "goodput_report", "aihpc.goodput.ettr"),
        ("aihpc.spec.model", "model_presets", "aihpc.runspec.model"),
    ],
)
def test_a_name_that_left_a_split_module_is_found_where_it_went(
    old: str, name: str, new: str
) -> None:
    alias = _fresh(old)
    assert getattr(alias, name) is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = alias.not_a_name


def test_the_old_spec_package_and_its_modules_in_a_fresh_process() -> None:
    """What a 0.1 user's script does, in a process of its own: ``from aihpc.spec import ...``,
    ``from aihpc.spec.model import ...`` and ``import aihpc.perf.estimate`` work, warn, and
    ``aihpc.perf.estimate`` still estimates."""
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from aihpc.spec import load_runspec, ModelSpec\n"
        "from aihpc.spec.model import model_presets\n"
        "import aihpc.runspec, aihpc.perf.estimate, aihpc.perf\n"
        "assert ModelSpec is aihpc.runspec.ModelSpec and 'llama3-8b' in model_presets()\n"
        "spec = load_runspec('examples/llama3-70b.toml')\n"
        "print(round(aihpc.perf.estimate(spec).mfu, 6) == round(aihpc.perf.estimate_plan("
        "spec.model, spec.cluster, spec.plan(), spec.training).mfu, 6))\n"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True
    )
    assert done.stdout.strip() == "True"
    warned = [line for line in done.stderr.splitlines() if "DeprecationWarning" in line]
    assert any("aihpc.spec moved to aihpc.runspec" in w for w in warned)
    assert any("aihpc.spec.model moved to aihpc.runspec.model" in w for w in warned)
    assert any("aihpc.perf.estimate moved to aihpc.perf.step.estimate" in w for w in warned)
