"""A launch script read by a real bash grammar (tree-sitter-bash), never run: the commands it
would run, each as the words the program would receive, and one line for each assumption made.

Followed: assignments (``NAME=``, ``NAME+=``, arrays ``NAME=(...)`` and ``NAME+=(...)``,
``export`` / ``declare`` / ``local`` / ``readonly``), ``$VAR``, ``${VAR}``, ``${VAR:-w}``,
``${VAR-w}``, ``${VAR:=w}``, ``${VAR:+w}``, ``${#VAR}``, ``${ARR[@]}`` / ``${ARR[*]}`` /
``${ARR[i]}``, ``$((...))`` (bounded, shell.arith), quoting and word splitting as bash does it
(an unquoted expansion splits on blanks, a quoted one does not, ``"${ARR[@]}"`` gives one word
per element), ``if`` / ``elif`` / ``else`` and ``case`` (the branch the variables select when
the condition is decidable from what the script sets; otherwise the branch a plain run takes,
named on one line), ``for`` over known words, functions the script calls, ``&&`` / ``||`` /
pipelines / redirections, and ``bash -c "..."`` strings. ``$(...)`` and backticks are not run:
their value is unknown (kept as their source text, noted); ``source`` is not followed (noted).
Positional parameters ($1...) are unset: a script run without arguments. The ``#SBATCH`` lines
before the first command (where sbatch reads them) set the variables Slurm gives the script
(``SLURM_NNODES`` from ``--nodes`` ...), each named on a note where the script reads it.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import tree_sitter_bash
from tree_sitter import Language, Node, Parser

from aihpc.interop.arith import arith
from aihpc.interop.bash_branches import Branches
from aihpc.interop.bash_sbatch import sbatch_env
from aihpc.runspec import SpecError

__all__ = ["Command", "Script", "read_script"]

_MAX_VALUE = 1 << 20  # characters of one expanded value
_MAX_WORDS = 100_000  # words of one array
_MAX_STEPS = 200_000  # nodes visited (a loop or recursion cannot run away)
_MAX_DEPTH = 64  # nested function calls / bash -c strings
_PARSER = Parser(Language(tree_sitter_bash.language()))


@dataclass
class Command:
    words: list[str]
    line: int  # 1-based line of the source script
    launcher: list[str] = field(default_factory=list)  # words before `bash -c` around it
    # the defaults taken for variables the environment may set that its words depend on
    assumes: list[str] = field(default_factory=list)
    # flags (``--name``) whose value word expanded to nothing -> that word's source text
    emptied: dict[str, str] = field(default_factory=dict)


@dataclass
class Script:
    commands: list[Command]
    notes: list[str]
    scalars: dict[str, str]
    arrays: dict[str, list[str]]


class _Unknown(Exception):
    """A value that cannot be known without running something."""


class _Exit(Exception):
    pass


class _Walker(Branches):
    def __init__(self, src: bytes, env: dict[str, str]) -> None:
        self.src = src
        self.sbatch: dict[str, str] = {}  # variable set from #SBATCH -> its note
        self.scalars: dict[str, str] = dict(env)
        self.arrays: dict[str, list[str]] = {}
        self.unknown: set[str] = set()
        self.set_here: set[str] = set(env)
        self.functions: dict[str, Node] = {}
        self.commands: list[Command] = []
        self.notes: list[str] = []
        self.steps = 0
        self.depth = 0
        self.launcher: list[str] = []
        # taint: the variables whose default (``${VAR:-w}``, VAR unset) a value depends on
        self.defaults: dict[str, str] = {}  # variable -> its one-line note
        self.origin: dict[str, set[str]] = {}  # script variable -> defaulted variables
        self.touched: set[str] = set()  # defaulted variables the current expansion read
        self.outer: set[str] = set()  # those of a `bash -c` string's command
        self.outer_emptied: dict[str, str] = {}  # its flags given an empty value

    # -- helpers ---------------------------------------------------------------------------
    def text(self, node: Node) -> str:
        return self.src[node.start_byte : node.end_byte].decode(errors="replace")

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def tick(self) -> None:
        self.steps += 1
        if self.steps > _MAX_STEPS:
            raise SpecError("SOURCE", f"{self.steps} steps", "a launch script of bounded size")

    def bounded(self, name: str, words: list[str]) -> list[str]:
        if len(words) > _MAX_WORDS or sum(map(len, words)) > _MAX_VALUE:
            raise SpecError(
                name, f"{len(words)} words", f"a value of at most {_MAX_VALUE >> 20} MiB is read"
            )
        return words

    # -- expansion -------------------------------------------------------------------------
    def var(self, name: str, node: Node) -> str | None:
        """A scalar's value (None when unset); an array's first element, as bash gives."""
        if name in self.arrays:
            return self.arrays[name][0] if self.arrays[name] else ""
        if name.isdigit() or name in ("@", "*", "#"):
            return "0" if name == "#" else None
        self.touched |= self.origin.get(name, set())
        if name in self.sbatch:
            self.note(self.sbatch[name])
        if name in self.unknown:
            self.note(f"${name} is not known without running the script: its text is kept")
        return self.scalars.get(name)

    def expansion(self, node: Node, quoted: bool) -> list[str] | str:
        """``${...}``: a string, or a list of words for ``${ARR[@]}``."""
        kids = [c for c in node.children if c.type not in ("${", "}")]
        length = bool(kids) and kids[0].type == "#"
        if length:
            kids = kids[1:]
        if not kids:
            raise _Unknown(self.text(node))
        target, rest = kids[0], kids[1:]
        if target.type == "subscript":
            name = self.text(target.child_by_field_name("name") or target.children[0])
            index = self.text(target.child_by_field_name("index") or target.children[2])
            items = self.arrays.get(name, [self.scalars[name]] if name in self.scalars else [])
            self.touched |= self.origin.get(name, set())
            if name in self.sbatch:
                self.note(self.sbatch[name])
            if rest:
                raise _Unknown(self.text(node))
            if index in ("@", "*"):
                if length:
                    return str(len(items))
                return items if index == "@" or not quoted else " ".join(items)
            if not index.isdigit():
                raise _Unknown(self.text(node))
            value = items[int(index)] if int(index) < len(items) else ""
            return str(len(value)) if length else value
        if target.type not in ("variable_name", "special_variable_name"):
            raise _Unknown(self.text(node))
        name = self.text(target)
        value = self.var(name, node)
        if length:
            return str(len(value or ""))
        if not rest:
            return value or ""
        op = rest[0].type
        word = "".join(self.join(self.parts(c, quoted=True)) for c in rest[1:])
        if op in (":-", "-", ":=", "=") and value is None and name not in self.set_here:
            why = (
                "read as run without arguments" if name.isdigit() else "the environment may set it"
            )
            self.defaults[name] = f"${name} unset ({why}): {self.text(node)} read as {word!r}"
            self.touched.add(name)
        if op in (":-", "-"):
            empty = value is None or (op == ":-" and value == "")
            return word if empty else value  # type: ignore[return-value]
        if op in (":=", "="):
            if value is None or (op == ":=" and value == ""):
                self.scalars[name] = word
                self.set_here.add(name)
                return word
            return value
        if op in (":+", "+"):
            return word if value else ""
        raise _Unknown(self.text(node))

    def arith(self, node: Node) -> str:
        inner = self.text(node)[3:-2]

        def sub(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(2) or m.group(3)
            value = self.var(name, node)
            return value if value not in (None, "") else "0"

        expr = re.sub(r"\$\{(\w+)\}|\$(\w+)|\b([A-Za-z_]\w*)\b", sub, inner)
        if not re.fullmatch(r"[0-9+\-*/% ()]+", expr):
            raise _Unknown(self.text(node))
        return str(arith(expr))

    def parts(self, node: Node, quoted: bool = False) -> list[tuple[str | list[str], bool]]:
        """The pieces of one word: (text or array items, split?) in order."""
        self.tick()
        t = node.type
        if t in ("word", "number", "extglob_pattern", "string_content", "variable_name"):
            return [(_unescape(self.text(node), quoted), False)]
        if t == "raw_string":
            return [(self.text(node)[1:-1], False)]
        if t == "ansi_c_string":
            return [(self.text(node)[2:-1], False)]
        if t == "concatenation":
            return [p for c in node.children for p in self.parts(c, quoted)]
        if t in ("string", "translated_string"):
            return self.string(node)
        if t == "simple_expansion":
            # the grammar may start the node at blanks before its $: the name is its child's
            kids = node.named_children
            name = self.text(kids[0]) if kids else self.text(node).strip()[1:]
            return [(self.var(name, node) or "", not quoted)]
        if t == "expansion":
            try:
                value = self.expansion(node, quoted)
            except _Unknown:
                self.note(f"{self.text(node)} is not read (not a form aihpc follows): unknown")
                return [(self.text(node), False)]
            return [(value, not quoted)]
        if t == "arithmetic_expansion":
            try:
                return [(self.arith(node), not quoted)]
            except _Unknown:
                self.note(f"{self.text(node)} is not integer arithmetic of known values")
                return [(self.text(node), False)]
        if t in ("command_substitution", "process_substitution"):
            self.note(f"{self.text(node)} is not run (nothing in the script is): its value unknown")
            return [(self.text(node), False)]
        return [(self.text(node), False)]

    def string(self, node: Node) -> list[tuple[str | list[str], bool]]:
        """A double-quoted string: its text between the children, unescaped, not split."""
        out: list[tuple[str | list[str], bool]] = [("", False)]  # "" is one (empty) word
        pos = node.start_byte + 1
        for c in node.children:
            if not c.is_named:
                continue
            # the grammar may start a node at the blanks before it: they are the string's
            raw = self.src[c.start_byte : c.end_byte]
            start = c.start_byte + len(raw) - len(raw.lstrip())
            if start > pos:
                out.append((_unescape(self.src[pos:start].decode(), True), False))
            out += self.parts(c, quoted=True)
            pos = c.end_byte
        if node.end_byte - 1 > pos:
            out.append((_unescape(self.src[pos : node.end_byte - 1].decode(), True), False))
        return out

    @staticmethod
    def join(parts: list[tuple[str | list[str], bool]]) -> str:
        return "".join(p if isinstance(p, str) else " ".join(p) for p, _ in parts)

    def fields(self, node: Node) -> list[str]:
        """One word of source → the words bash passes after expansion and splitting."""
        out: list[str] = [""]
        real = [False]
        for piece, split in self.parts(node):
            items = piece if isinstance(piece, list) else [piece]
            for k, item in enumerate(items):
                if k:
                    out.append("")
                    real.append(True)
                if not split:
                    out[-1] += item
                    real[-1] = True
                    continue
                words = item.split()
                if words and item[:1].isspace() and out[-1]:
                    out.append("")
                    real.append(False)
                for j, w in enumerate(words):
                    if j:
                        out.append("")
                        real.append(False)
                    out[-1] += w
                if words and item[-1:].isspace():
                    out.append("")
                    real.append(False)
        return [w for w, r in zip(out, real, strict=True) if w or r]

    # -- statements ------------------------------------------------------------------------
    def walk(self, node: Node) -> None:
        self.tick()
        t = node.type
        if t in ("program", "compound_statement", "do_group", "subshell", "list", "pipeline"):
            for c in node.named_children:
                self.walk(c)
        elif t == "redirected_statement":
            body = node.child_by_field_name("body")
            if body is not None:
                self.walk(body)
        elif t == "variable_assignment":
            self.assign(node)
        elif t == "variable_assignments":
            for c in node.named_children:
                self.assign(c)
        elif t == "declaration_command":
            for c in node.named_children:
                if c.type == "variable_assignment":
                    self.assign(c)
        elif t == "command":
            self.command(node)
        elif t == "if_statement":
            self.if_statement(node)
        elif t == "case_statement":
            self.case(node)
        elif t == "for_statement":
            self.for_loop(node)
        elif t == "function_definition":
            name = node.child_by_field_name("name")
            body = node.child_by_field_name("body")
            if name is not None and body is not None:
                self.functions[self.text(name)] = body
        elif t in ("while_statement", "c_style_for_statement"):
            self.note(f"line {node.start_point[0] + 1}: a loop is not followed")
        elif t == "ERROR":
            raise SpecError(
                "SOURCE", f"line {node.start_point[0] + 1}", "bash cannot parse the script here"
            )

    def assign(self, node: Node) -> None:
        name_node = node.child_by_field_name("name")
        if name_node is None:
            return
        name = self.text(name_node)
        if name_node.type == "subscript":
            return  # ARR[i]=x: rare in launch scripts
        append = any(c.type == "+=" for c in node.children)
        value = node.child_by_field_name("value")
        self.unknown.discard(name)
        self.sbatch.pop(name, None)
        self.touched = set()
        try:
            self.assign_value(name, value, append)
        finally:
            old = self.origin.get(name, set()) if append else set()
            self.origin[name] = old | self.touched

    def assign_value(self, name: str, value: Node | None, append: bool) -> None:
        if value is not None and value.type == "array":
            # a comment inside ( ... ) is no element (slime's scripts comment flags out there)
            kids = [c for c in value.named_children if c.type != "comment"]
            items = [w for c in kids for w in self.fields(c)]
            old = self.arrays.get(name, [self.scalars[name]] if name in self.scalars else [])
            self.arrays[name] = self.bounded(name, (old if append else []) + items)
            self.scalars.pop(name, None)
            self.set_here.add(name)
            return
        parts = self.parts(value, quoted=True) if value is not None else []
        self.set_here.add(name)
        if (
            any(isinstance(p, str) and p.startswith(("$(", "`")) and not s for p, s in parts)
            and value is not None
            and value.type in ("command_substitution", "string")
        ):
            self.unknown.add(name)
        text = self.join(parts)
        if name in self.arrays:
            arr = self.arrays[name]
            self.arrays[name] = self.bounded(name, [*arr, text] if append else [text, *arr[1:]])
            return
        old = self.scalars.get(name, "") if append else ""
        self.scalars[name] = self.bounded(name, [old + text])[0]

    def command(self, node: Node) -> None:
        name_node = node.child_by_field_name("name")
        words: list[str] = []
        emptied: dict[str, str] = dict(self.outer_emptied)
        self.touched = set(self.outer)
        for c in node.named_children:
            if c.type in ("variable_assignment", "file_redirect", "herestring_redirect"):
                continue
            got = self.fields(c.named_children[0] if c.type == "command_name" else c)
            if not got and words and words[-1].startswith("--") and "=" not in words[-1]:
                emptied[words[-1]] = self.text(c).strip()
            words += got
        if not words:
            return
        line = node.start_point[0] + 1
        head = words[0].rsplit("/", 1)[-1]
        if head == "exit":
            raise _Exit
        if head in ("source", ".") and name_node is not None:
            self.note(f"line {line}: `{' '.join(words[:2])}` is not followed (not read)")
            return
        if head in ("set", "shift", "unset", "cd", "mkdir", "echo", "printf", ":"):
            if head == "unset":
                for w in words[1:]:
                    self.sbatch.pop(w, None)
                    self.scalars.pop(w, None)
                    self.arrays.pop(w, None)
            return
        if head in self.functions and self.depth < _MAX_DEPTH:
            self.depth += 1
            self.walk(self.functions[head])
            self.depth -= 1
            return
        assumes = [self.defaults[v] for v in sorted(self.touched)]
        self.commands.append(Command(words, line, list(self.launcher), assumes, emptied))
        for i, w in enumerate(words[:-2]):
            if w.rsplit("/", 1)[-1] in ("bash", "sh") and words[i + 1] == "-c":
                saved, self.outer = self.outer, set(self.touched)
                saved_emptied, self.outer_emptied = self.outer_emptied, emptied
                try:
                    self.sub_script(words[i + 2], words[:i])
                finally:
                    self.outer, self.outer_emptied = saved, saved_emptied
                break

    def sub_script(self, text: str, launcher: list[str]) -> None:
        if self.depth >= _MAX_DEPTH:
            return
        saved, saved_launcher = self.src, self.launcher
        self.src, self.launcher = text.encode(), [*self.launcher, *launcher]
        self.depth += 1
        try:
            self.walk(_PARSER.parse(self.src).root_node)
        finally:
            self.depth -= 1
            self.src, self.launcher = saved, saved_launcher

    def for_loop(self, node: Node) -> None:
        var = node.child_by_field_name("variable")
        body = node.child_by_field_name("body")
        values = node.children_by_field_name("value")
        if var is None or body is None or not values:
            self.note(f"line {node.start_point[0] + 1}: a loop is not followed")
            return
        items = [w for v in values for w in self.fields(v)]
        for item in self.bounded(self.text(var), items)[:1024]:
            self.scalars[self.text(var)] = item
            self.set_here.add(self.text(var))
            self.walk(body)


def _unescape(text: str, quoted: bool) -> str:
    if quoted:
        return re.sub(r'\\([$`"\\\n])', lambda m: "" if m.group(1) == "\n" else m.group(1), text)
    return re.sub(r"\\(.)", r"\1", text, flags=re.S)


def _drop_final_continuation(text: str) -> str:
    """``text`` without a line continuation that ends the file (``\\`` then at most a newline,
    as several of verl's recipe scripts end): bash joins it to nothing and runs the command;
    tree-sitter-bash finds no word after it and errs. An escaped backslash (``\\\\``) stays."""
    body = text[:-1] if text.endswith("\n") else text
    trailing = len(body) - len(body.rstrip("\\"))
    return body[:-1] if trailing % 2 else text


def read_script(text: str, env: dict[str, str] | None = None) -> Script:
    """The commands ``text`` would run (expanded as bash would, nothing executed) and the
    assumptions made reading it; SpecError (one line) when bash could not parse it."""
    src = _drop_final_continuation(text).encode(errors="replace")
    slurm = {k: v for k, v in sbatch_env(text).items() if k not in (env or {})}
    walker = _Walker(src, {**{k: v for k, (v, _) in slurm.items()}, **(env or {})})
    walker.sbatch = {k: note for k, (_, note) in slurm.items()}
    try:
        with contextlib.suppress(_Exit):
            walker.walk(_PARSER.parse(src).root_node)
    except RecursionError:
        raise SpecError(
            "SOURCE", "nesting", "a launch script nested this deep is not read"
        ) from None
    return Script(walker.commands, walker.notes, walker.scalars, walker.arrays)
