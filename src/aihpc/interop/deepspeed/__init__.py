"""DeepSpeed config JSON (+ the model, which DeepSpeed's config does not describe) ⇄ run spec:
``reader`` imports, ``writer`` exports, ``defaults`` holds what DeepSpeed fixes either way."""

from aihpc.interop.deepspeed.defaults import FIXED, FRAMEWORK
from aihpc.interop.deepspeed.reader import import_deepspeed
from aihpc.interop.deepspeed.writer import export_deepspeed

__all__ = ["FIXED", "FRAMEWORK", "export_deepspeed", "import_deepspeed"]
