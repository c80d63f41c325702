"""Read the console examples of README.md and docs/**/*.md and compare output as a reader would.

The rules (docs/doc-examples.md says them for writers):

* A ```` ```console ```` block is run: each ``$ `` line is a bash command (a line ending in ``\\``
  continues on the next), and the lines after it, up to the next ``$ `` line, are the output it
  must print (stdout and stderr together, as a terminal shows them).
* Lines are compared with their runs of spaces collapsed, and table rules (``━━━╇━━``) with their
  repeated characters collapsed, so a column that grows by one digit does not fail the example.
  Blank lines are ignored.
* ``...`` alone on a line stands for any number of lines; ``...`` inside a line for any text.
* ``# abridged`` at the end of a command: the lines shown appear in this order, with any lines
  between them.
* HTML comments right above the block (invisible on GitHub) say what cannot be written down:
  ``<!-- example volatile: REGEX -->`` marks text that differs between runs (a timing, a process
  id): where REGEX matches the expected text, the actual text must match REGEX there;
  ``<!-- example exit: N -->`` the exit code the commands end with (default 0);
  ``<!-- example timeout: S -->`` seconds per command (default 180; stretched by the load,
  tests/hang_bounds.py);
  ``<!-- example skip: REASON -->`` an example that cannot run in CI (needs a GPU or a cluster).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_RULE_CHARS = set("─━│┃┄┅┆┇┈┉┊┋╇╈╉╊╋┼┿╀╁╂┳┻┣┫┏┓┗┛┡┩╞╡╪═╤╧╟╢ ")
_DIRECTIVE = re.compile(r"<!--\s*example\s+(volatile|exit|timeout|skip):\s?(.*?)\s*-->")


@dataclass
class Command:
    text: str
    expected: list[str]
    abridged: bool = False


@dataclass
class Example:
    path: Path
    line: int
    commands: list[Command]
    volatile: list[str] = field(default_factory=list)
    exit_code: int = 0
    timeout_s: float = 180.0
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _directives(lines: list[str], fence: int) -> list[tuple[str, str]]:
    """The example directives in the comment lines right above line ``fence``."""
    out = []
    i = fence - 1
    while i >= 0 and lines[i].strip().startswith("<!--"):
        m = _DIRECTIVE.search(lines[i])
        if m:
            out.append((m.group(1), m.group(2)))
        i -= 1
    return out[::-1]


def _commands(body: list[str]) -> list[Command]:
    cmds: list[Command] = []
    pending = ""
    for raw in body:
        if pending:  # a continued command line
            pending += "\n" + raw
        elif raw.startswith("$ "):
            pending = raw[2:]
        elif cmds:
            cmds[-1].expected.append(raw)
            continue
        else:
            continue  # output before the first command: nothing to compare it with
        if not pending.endswith("\\"):
            abridged = re.search(r"#[^'\"]*\babridged\b[^'\"]*$", pending) is not None
            cmds.append(Command(pending, [], abridged))
            pending = ""
    return cmds


def parse(path: Path) -> list[Example]:
    lines = path.read_text(encoding="utf-8").splitlines()
    examples, i = [], 0
    while i < len(lines):
        fence = lines[i].strip()[:3]
        if fence in ("```", "~~~") and lines[i].strip() != "```console":
            # another block (which may show a console block as text, inside ~~~): skip it whole
            i = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), i) + 1
            continue
        if lines[i].strip() == "```console":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            ex = Example(path, i + 1, _commands(lines[i + 1 : end]))
            for key, value in _directives(lines, i):
                if key == "volatile":
                    ex.volatile.append(value)
                elif key == "exit":
                    ex.exit_code = int(value)
                elif key == "timeout":
                    ex.timeout_s = float(value)
                else:
                    ex.skip = value
            examples.append(ex)
            i = end
        i += 1
    return examples


def all_examples() -> list[Example]:
    return [ex for path in doc_files() for ex in parse(path)]


def normalize(line: str) -> str:
    """Runs of spaces collapsed; a table rule's repeated characters too."""
    text = " ".join(line.split())
    if text and set(text) <= _RULE_CHARS:
        text = re.sub(r"(.)\1+", r"\1", text.replace(" ", ""))
    return text


@cache
def _pattern(expected: str, volatile: tuple[str, ...]) -> re.Pattern[str]:
    """The regex an actual line must match: literal text, volatile spans, ``...`` wildcards."""
    spans: list[tuple[int, int, str]] = []
    for rx in volatile:
        for m in re.finditer(rx, expected):
            if m.end() > m.start() and not any(s < m.end() and m.start() < e for s, e, _ in spans):
                spans.append((m.start(), m.end(), f"(?:{rx})"))
    for m in re.finditer(re.escape("..."), expected):
        if not any(s < m.end() and m.start() < e for s, e, _ in spans):
            spans.append((m.start(), m.end(), ".*"))
    out, pos = [], 0
    for start, end, rx in sorted(spans):
        out += [re.escape(expected[pos:start]), rx]
        pos = end
    out.append(re.escape(expected[pos:]))
    return re.compile("".join(out))


def lines_match(
    expected: list[str], actual: list[str], volatile: list[str], abridged: bool
) -> bool:
    """Whether ``actual`` (normalised, no blank lines) is what ``expected`` describes."""
    exp = [normalize(x) for x in expected if x.strip()]
    act = [normalize(x) for x in actual if x.strip()]
    if abridged:  # every shown line in order, anything between: "..." around each line
        exp = ["...", *[y for x in exp for y in (x, "...")]]
    vol = tuple(volatile)

    @cache
    def match(i: int, j: int) -> bool:
        if i == len(exp):
            return j == len(act)
        if exp[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(act) + 1))
        return (
            j < len(act) and bool(_pattern(exp[i], vol).fullmatch(act[j])) and match(i + 1, j + 1)
        )

    return match(0, 0)
