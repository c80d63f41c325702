"""Just enough of bash to read a training launch script: variable assignments (scalars and
arrays, ``export``), ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``${ARR[@]}`` / ``$((a*b))``
expansion, backslash continuations and comments. It never runs anything.

Arithmetic is bash's, bounded: integers of at most 19 digits, + - * / % and ** on 64-bit signed
values that wrap as bash's do (a power by modular exponentiation, so ``2**2**2**2**2**2`` is one
step, not a hang), parentheses at most 32 deep; division by zero or a negative exponent (bash's
own errors) is one line naming the expression. Expanded values are capped in size, so an array
doubled on every line cannot fill memory. (Issue 36 replaces this reader with a real parser.)
"""

from __future__ import annotations

import re
import shlex

from aihpc.runspec import SpecError

__all__ = ["arith", "command_tokens", "expand_script"]

_MAX_DIGITS = 19  # 2**63 - 1 has 19
_MAX_PARENS = 32
_MAX_EXPR = 4096  # characters of one $(( )) after expansion
_MAX_WORDS = 100_000  # words of one array
_MAX_VALUE = 1 << 20  # characters of one expanded value
_TOKEN = re.compile(r"\s*(?:(\d+)|(\*\*|[-+*/%()]))")

_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_VAR = re.compile(
    r"\$\(\((?P<arith>[^()]*)\)\)"
    r"|\$\{(?P<arr>[A-Za-z_]\w*)\[[@*]\]\}"
    r"|\$\{(?P<name>[A-Za-z_]\w*)(?::-(?P<default>[^}]*))?\}"
    r"|\$(?P<bare>[A-Za-z_]\w*)"
)
_ARITH = re.compile(r"[0-9+\-*/% ()]+")


def _wrap(n: int) -> int:
    """``n`` as bash's 64-bit signed integer (arithmetic wraps around, never grows)."""
    return (n + 2**63) % 2**64 - 2**63


class _Arith:
    """A recursive-descent evaluator of bash's integer arithmetic (the subset a launch script
    uses): expr := term (+|- term)*; term := power (*|/|% power)*; power := unary (** power)?;
    unary := (+|-) unary | number | ( expr )."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.tokens: list[str] = []
        pos = 0
        while pos < len(expr.rstrip()):
            m = _TOKEN.match(expr, pos)
            if m is None:
                self.fail("not integer arithmetic")
            self.tokens.append(m.group(1) or m.group(2))
            pos = m.end()
        self.i = 0
        self.depth = 0

    def fail(self, why: str) -> None:
        raise SpecError("$((...))", self.expr.strip()[:80], why)

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            self.fail("the expression ends early")
        self.i += 1
        return tok  # type: ignore[return-value]

    def value(self) -> int:
        out = self.sum()
        if self.peek() is not None:
            self.fail(f"unexpected {self.peek()!r}")
        return out

    def sum(self) -> int:
        out = self.term()
        while self.peek() in ("+", "-"):
            out = _wrap(out + self.term() if self.take() == "+" else out - self.term())
        return out

    def term(self) -> int:
        out = self.power()
        while self.peek() in ("*", "/", "%"):
            op = self.take()
            rhs = self.power()
            if op == "*":
                out = _wrap(out * rhs)
                continue
            if rhs == 0:
                self.fail("division by zero (bash stops the script here)")
            q = abs(out) // abs(rhs) * (1 if (out < 0) == (rhs < 0) else -1)  # C truncation
            out = _wrap(q) if op == "/" else _wrap(out - q * rhs)
        return out

    def power(self) -> int:
        base = self.unary()
        if self.peek() != "**":
            return base
        self.take()
        exp = self.power()  # right-associative, as bash's
        if exp < 0:
            self.fail("a negative exponent (bash refuses it)")
        return _wrap(pow(base, exp, 2**64))

    def unary(self) -> int:
        tok = self.take()
        if tok in ("+", "-"):
            self.depth += 1  # a chain of signs nests as parentheses do
            if self.depth > _MAX_PARENS * 4:
                self.fail("too many signs in a row")
            out = self.unary()
            self.depth -= 1
            return out if tok == "+" else _wrap(-out)
        if tok == "(":
            self.depth += 1
            if self.depth > _MAX_PARENS:
                self.fail(f"parentheses nested deeper than {_MAX_PARENS}")
            out = self.sum()
            if self.take() != ")":
                self.fail("a parenthesis is not closed")
            self.depth -= 1
            return out
        if not tok.isdigit():
            self.fail(f"unexpected {tok!r}")
        if len(tok.lstrip("0")) > _MAX_DIGITS:
            self.fail(f"a number of more than {_MAX_DIGITS} digits (bash's integers are 64-bit)")
        if tok[0] == "0" and len(tok) > 1:  # bash reads a leading 0 as octal
            if not set(tok) <= set("01234567"):
                self.fail(f"{tok} is not octal (bash reads a leading 0 as base 8)")
            return _wrap(int(tok, 8))
        return _wrap(int(tok))


def arith(expr: str) -> int:
    """The value of bash integer arithmetic ``expr`` (numbers and operators, variables already
    expanded), bounded as the module says; SpecError when bash would refuse it."""
    if len(expr) > _MAX_EXPR:
        raise SpecError("$((...))", f"{expr[:40]}...", f"longer than {_MAX_EXPR} characters")
    return _Arith(expr).value()


def _expand(word: str, scalars: dict[str, str], arrays: dict[str, list[str]]) -> list[str]:
    """One shell word → its words after expansion (an array expands to several)."""
    whole = _VAR.fullmatch(word)
    if whole and whole.group("arr"):
        return list(arrays.get(whole.group("arr"), []))

    def sub(m: re.Match[str]) -> str:
        if m.group("arith") is not None:
            expr = _VAR.sub(sub, m.group("arith"))
            expr = re.sub(r"[A-Za-z_]\w*", lambda v: scalars.get(v.group(0), "0"), expr)
            return str(arith(expr)) if _ARITH.fullmatch(expr) else ""
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


def _bounded(words: list[str], name: str) -> list[str]:
    """``words``, or one line when a variable grows past what a launch script holds (an array
    doubled line after line would otherwise fill memory)."""
    if len(words) > _MAX_WORDS or sum(map(len, words)) > _MAX_VALUE:
        raise SpecError(
            name, f"{len(words)} words", f"a value of at most {_MAX_VALUE >> 20} MiB is read"
        )
    return words


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
            arrays[m.group(1)] = _bounded([e for e in expanded if e], m.group(1))
            continue
        if m and all(_ASSIGN.match(w) for w in words):
            for w in words:
                name, value = _ASSIGN.match(w).groups()  # type: ignore[union-attr]
                scalars[name] = _bounded([" ".join(_expand(value, scalars, arrays))], name)[0]
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
