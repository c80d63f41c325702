"""bash's integer arithmetic for ``$((...))`` in a launch script, bounded: integers of at most
19 digits, + - * / % and ** on 64-bit signed values that wrap as bash's do (a power by modular
exponentiation, so ``2**2**2**2**2**2`` is one step, not a hang), parentheses at most 32 deep;
division by zero or a negative exponent (bash's own errors) is one line naming the expression.
"""

from __future__ import annotations

import re

from aihpc.runspec import SpecError

__all__ = ["arith"]

_MAX_DIGITS = 19  # 2**63 - 1 has 19
_MAX_PARENS = 32
_MAX_EXPR = 4096  # characters of one $(( )) after expansion
_TOKEN = re.compile(r"\s*(?:(\d+)|(\*\*|[-+*/%()]))")


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
