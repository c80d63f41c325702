"""The branches of a launch script (interop/bash.py): ``if`` / ``elif`` / ``else`` and ``case``
take the branch the script's own variables select; a condition that depends on something else
(an unset variable the environment may set, a file, a command's status, ``$(...)``) takes the
value of a plain run (unset variables empty, files present, commands succeeding) and says so on
one line."""

from __future__ import annotations

import fnmatch
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tree_sitter import Node

__all__ = ["Branches"]

_FILE_TESTS = {"-f", "-d", "-e", "-r", "-w", "-x", "-s", "-L", "-h"}


def _descendants(node: Node) -> list[Node]:
    out = [node]
    for c in node.children:
        out += _descendants(c)
    return out


class Branches:
    """Mixed into bash.py's walker (which gives text, note, fields, parts, join, walk)."""

    set_here: set[str]
    touched: set[str]
    defaults: dict[str, str]
    assumed: list[str]
    text: Any
    note: Any
    fields: Any
    parts: Any
    join: Any
    walk: Any

    # -- branches --------------------------------------------------------------------------
    def if_statement(self, node: Node) -> None:
        first = self.clause(node)
        rest = [c for c in node.children if c.type in ("elif_clause", "else_clause")]
        for cond, body in [first, *map(self.clause, rest)]:
            if not cond or self.decide(cond[-1]):
                for b in body:
                    self.walk(b)
                return

    def clause(self, node: Node) -> tuple[list[Node], list[Node]]:
        """(condition, body) of an if / elif / else (an else: no condition)."""
        if node.type == "else_clause":
            return [], [c for c in node.named_children if c.type != "comment"]
        cond: list[Node] = []
        body: list[Node] = []
        in_body = False
        for c in node.children:
            if c.type == "then":
                in_body = True
            elif c.type in ("elif_clause", "else_clause"):
                break
            elif c.is_named and c.type != "comment":
                (body if in_body else cond).append(c)
        return cond, body

    def decide(self, node: Node) -> bool:
        """The condition's value: decided from the variables the script sets, else the value of
        a plain run (unset variables empty, files present, commands succeeding), noted."""
        self.assumed: list[str] = []
        self.touched = set()
        value = self.test(node)
        for name in sorted(self.touched):  # a default taken steers the branch: say it
            self.note(self.defaults[name])
        if self.assumed:
            self.note(
                f"line {node.start_point[0] + 1}: assumed `{self.text(node)}` is "
                f"{'true' if value else 'false'} ({'; '.join(dict.fromkeys(self.assumed))})"
            )
        return value

    def operand(self, node: Node) -> str:
        for n in _descendants(node):
            if n.type in ("simple_expansion", "expansion"):
                name = next((self.text(k) for k in n.named_children), self.text(n))
                name = re.sub(r"\[.*", "", name.lstrip("$"))
                if name not in self.set_here and not name.isdigit():
                    self.assumed.append(f"${name} unset")
            if n.type == "command_substitution":
                self.assumed.append(f"{self.text(n)} not run")
        return " ".join(self.fields(node))

    def test(self, node: Node) -> bool:
        t = node.type
        kids = [c for c in node.children if c.type != "comment"]
        if t == "test_command":
            inner = [c for c in kids if c.is_named]
            return self.test(inner[0]) if inner else False
        if t in ("parenthesized_expression",):
            return self.test(node.named_children[0])
        if t == "negated_command" or (kids and kids[0].type == "!"):
            return not self.test(node.named_children[-1])
        if t == "unary_expression":
            op = self.text(kids[0])
            arg = self.operand(kids[-1])
            if op in _FILE_TESTS:
                self.assumed.append(f"{arg or 'the path'} exists where the script runs")
                return True
            if op in ("-z", "-n"):
                return (arg == "") == (op == "-z")
            self.assumed.append(f"{op} not evaluated")
            return True
        if t in ("binary_expression", "list"):
            left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
            op_node = node.child_by_field_name("operator")
            op = self.text(op_node) if op_node is not None else self.text(kids[1])
            if left is None or right is None:
                left, right = node.named_children[0], node.named_children[-1]
            if op in ("&&", "-a"):
                return self.test(left) and self.test(right)
            if op in ("||", "-o"):
                return self.test(left) or self.test(right)
            a, b = self.operand(left), self.operand(right)
            return self.compare(a, op, b)
        if t == "string" or t == "word" or t == "simple_expansion":
            return self.operand(node) != ""
        self.assumed.append("a command's status, taken as success")
        return True

    def compare(self, a: str, op: str, b: str) -> bool:
        if op in ("=", "=="):
            return fnmatch.fnmatchcase(a, b)
        if op == "!=":
            return not fnmatch.fnmatchcase(a, b)
        if op == "=~":
            try:
                return re.search(b, a) is not None
            except re.error:
                self.assumed.append(f"=~ {b} not evaluated")
                return True
        ints = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__}
        ints |= {"-gt": int.__gt__, "-ge": int.__ge__}
        if op in ints:
            try:
                return bool(ints[op](int(a or "0"), int(b or "0")))
            except ValueError:
                self.assumed.append(f"{a!r} {op} {b!r} is not integers")
                return True
        if op in ("<", ">"):
            return a < b if op == "<" else a > b
        self.assumed.append(f"{op} not evaluated")
        return True

    def case(self, node: Node) -> None:
        value_node = node.child_by_field_name("value")
        self.assumed = []
        self.touched = set()
        value = self.operand(value_node) if value_node is not None else ""
        for name in sorted(self.touched):
            self.note(self.defaults[name])
        for item in (c for c in node.named_children if c.type == "case_item"):
            patterns, body, in_body = [], [], False
            for c in item.children:
                if c.type == ")":
                    in_body = True
                elif c.is_named and c.type != "comment":
                    (body if in_body else patterns).append(c)
            if any(fnmatch.fnmatchcase(value, self.join(self.parts(p))) for p in patterns):
                if self.assumed:
                    self.note(
                        f"line {item.start_point[0] + 1}: assumed case "
                        f"`{self.text(item).splitlines()[0]}` ({'; '.join(self.assumed)})"
                    )
                for b in body:
                    self.walk(b)
                return
