"""docs/run-spec.md is what the code generates, and it documents every field the code accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from aihpc.runspec import reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "run-spec.md"
REGENERATE = "python -m aihpc.runspec.reference > docs/run-spec.md"


def test_every_field_has_a_meaning_and_no_meaning_is_stale() -> None:
    docs = reference.field_docs()
    for section, names in reference.section_fields().items():
        missing = [n for n in names if not docs.get(section, {}).get(n, {}).get("doc")]
        assert not missing, f"add to src/aihpc/runspec/data/fields.toml [{section}]: {missing}"
        stale = sorted(set(docs.get(section, {})) - set(names))
        assert not stale, f"[{section}] in fields.toml has fields the code lacks: {stale}"


def test_the_page_is_what_the_code_generates() -> None:
    assert DOC.read_text(encoding="utf-8") == reference.render(), (
        f"docs/run-spec.md is out of date: run `{REGENERATE}`"
    )


def test_sections_are_the_run_specs_tables() -> None:
    """Every table the loader accepts has a section on the page (and [cluster.gpu_spec],
    [model.vision])."""
    from aihpc.runspec.runspec import SECTIONS

    assert set(reference.section_fields()) == {*SECTIONS, "gpu_spec", "vision", "rl.rollout"}


@pytest.mark.parametrize(
    ("section", "name", "allowed"),
    [
        ("training", "attention", "flash | flash2 | flex | triton | flash1 | unfused"),
        ("parallel", "zero_stage", "0 | 1 | 2 | 3"),
        ("training", "dropout", "a number in [0, 1)"),
        ("model", "num_layers", "must be a finite number > 0"),
    ],
)
def test_allowed_values_are_the_checks_own_words(section: str, name: str, allowed: str) -> None:
    """The allowed column quotes the one-line error a wrong value raises."""
    assert reference._allowed(section, name) == allowed


def test_read_by_follows_the_code() -> None:
    assert reference._read_by("training", "learning_rate") == "trainer"  # the optimizer only
    assert reference._read_by("training", "cp_exchange") == "planner"  # priced, not run
    # read through a spec property: scale_up_domain via ClusterSpec.nvlink_domain
    assert "planner" in reference._read_by("cluster", "scale_up_domain")
    assert reference._read_by("model", "name") == "output only"
