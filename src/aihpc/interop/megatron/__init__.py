"""Megatron-LM ``pretrain_gpt.py`` arguments ⇄ run spec: ``reader`` imports a launch script or an
arguments file (``flags`` splits the words, ``shape`` reads the model), ``writer`` exports a
launch script."""

from aihpc.interop.megatron.flags import FIXED, FRAMEWORK, parse_flags
from aihpc.interop.megatron.reader import import_megatron
from aihpc.interop.megatron.writer import export_megatron

__all__ = ["FIXED", "FRAMEWORK", "export_megatron", "import_megatron", "parse_flags"]
