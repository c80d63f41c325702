"""A training launch script's commands (read by interop/bash.py's real bash grammar, never run;
expanded values are capped in size, so an array doubled on every line cannot fill memory) and
the one that launches Megatron-LM. bash's bounded integer arithmetic (interop/arith.py) is
re-exported as ``arith``."""

from __future__ import annotations

import re

from aihpc.interop.arith import arith
from aihpc.interop.bash import Script, read_script

__all__ = ["arith", "command_tokens", "expand_script", "launch_command"]

_LAUNCHER = re.compile(
    r"(python[0-9.]*|torchrun|srun|mpirun|mpiexec|deepspeed|uv|nsys|numactl|env|"
    r"accelerate|bash|sh|taskset|timeout|apptainer|singularity|docker|enroot)"
)
_ENTRY = re.compile(r"(?:^|/)(pretrain_\w+)(?:\.py)?$")


def expand_script(text: str) -> list[list[str]]:
    """The script's commands (not its assignments), each as its expanded words."""
    return [c.launcher + c.words for c in read_script(text).commands]


def launch_command(
    script: Script,
) -> tuple[list[str], str, list[str], list[str], dict[str, str]] | None:
    """(launcher words, entry such as ``pretrain_gpt``, program arguments, the defaults taken
    for environment variables its words depend on, one note each, the flags whose value word
    expanded to nothing with that word's source text) of the command that
    runs a Megatron-LM ``pretrain_*.py`` (directly, under python / torchrun / srun ...), found
    after expansion; None when no command does. A test (``[ -f pretrain_gpt.py ]``), an echo or
    a copy of the file is not a launch."""
    for cmd in script.commands:
        words = cmd.launcher + cmd.words
        for i, w in enumerate(words):
            m = _ENTRY.search(w)
            if m is None:
                continue
            head = words[0].rsplit("/", 1)[-1]
            if i == 0 or _LAUNCHER.fullmatch(head):
                return words[:i], m.group(1), words[i + 1 :], cmd.assumes, cmd.emptied
    return None


def command_tokens(text: str, entry: str) -> tuple[list[str], list[str]] | None:
    """(launcher words, program arguments) of the command that runs ``entry`` (a script name
    such as ``pretrain_gpt.py``), or None when no command does."""
    found = launch_command(read_script(text))
    if found is None or found[1] != entry.removesuffix(".py"):
        return None
    return found[0], found[2]
