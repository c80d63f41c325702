"""Just enough of bash to read a training launch script: variable assignments (scalars and
arrays, ``export``), ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``${ARR[@]}`` / ``$((a*b))``
expansion, backslash continuations and comments. It never runs anything."""

from __future__ import annotations

import re
import shlex

__all__ = ["command_tokens", "expand_script"]

_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_VAR = re.compile(
    r"\$\(\((?P<arith>[^()]*)\)\)"
    r"|\$\{(?P<arr>[A-Za-z_]\w*)\[[@*]\]\}"
    r"|\$\{(?P<name>[A-Za-z_]\w*)(?::-(?P<default>[^}]*))?\}"
    r"|\$(?P<bare>[A-Za-z_]\w*)"
)
_ARITH = re.compile(r"[0-9+\-*/ ()]+")


def _expand(word: str, scalars: dict[str, str], arrays: dict[str, list[str]]) -> list[str]:
    """One shell word → its words after expansion (an array expands to several)."""
    whole = _VAR.fullmatch(word)
    if whole and whole.group("arr"):
        return list(arrays.get(whole.group("arr"), []))

    def sub(m: re.Match[str]) -> str:
        if m.group("arith") is not None:
            expr = _VAR.sub(sub, m.group("arith"))
            expr = re.sub(r"[A-Za-z_]\w*", lambda v: scalars.get(v.group(0), "0"), expr)
            return str(int(eval(expr, {}, {}))) if _ARITH.fullmatch(expr) else ""
        if m.group("arr"):
            return " ".join(arrays.get(m.group("arr"), []))
        name = m.group("name") or m.group("bare")
        value = scalars.get(name, arrays.get(name, [""])[0] if name in arrays else "")
        if not value and m.group("default") is not None:
            return m.group("default")
        return value

    return [_VAR.sub(sub, word)]


def _statements(text: str) -> list[list[str]]:
    text = text.replace("\\\n", " ")
    out: list[list[str]] = []
    pending: list[str] = []
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True, posix=True)
        except ValueError:
            continue  # an unbalanced quote: not a line this reader needs
        if pending:
            pending += words
            if ")" in words:
                out.append(pending[: pending.index(")") + 1])
                pending = []
            continue
        if words and words[0].endswith("=(") and ")" not in words:
            pending = words
            continue
        if words:
            out.append(words)
    return out


def expand_script(text: str) -> list[list[str]]:
    """The script's commands (not its assignments), each as its expanded words."""
    scalars: dict[str, str] = {}
    arrays: dict[str, list[str]] = {}
    commands = []
    for words in _statements(text):
        if words[0] in ("export", "declare", "local", "readonly"):
            words = [w for w in words[1:] if not w.startswith("-")] or words
        m = _ASSIGN.match(words[0])
        if m and m.group(2).startswith("("):  # NAME=( a b c ) or NAME=(a)
            items = [m.group(2)[1:], *words[1:]]
            items = [w.rstrip(")") for w in items if w not in ("", ")")]
            expanded = [e for w in items for e in _expand(w, scalars, arrays)]
            arrays[m.group(1)] = [e for e in expanded if e]
            continue
        if m and all(_ASSIGN.match(w) for w in words):
            for w in words:
                name, value = _ASSIGN.match(w).groups()  # type: ignore[union-attr]
                scalars[name] = " ".join(_expand(value, scalars, arrays))
            continue
        commands.append([e for w in words for e in _expand(w, scalars, arrays) if e != ""])
    return commands


def command_tokens(text: str, entry: str) -> tuple[list[str], list[str]] | None:
    """(launcher words, program arguments) of the first command that runs ``entry`` (a script
    name such as ``pretrain_gpt.py``), or None when no command does."""
    for words in expand_script(text):
        for i, w in enumerate(words):
            if w.endswith(entry):
                return words[:i], words[i + 1 :]
    return None
