"""Framework configs ⇄ run spec: Megatron-LM launch arguments, torchtitan TOML, DeepSpeed JSON;
and the Slurm batch script for ``aihpc train``. Never imports torch or the frameworks."""

from aihpc.interop._common import Imported, model_fields
from aihpc.interop.deepspeed import export_deepspeed, import_deepspeed
from aihpc.interop.megatron import export_megatron, import_megatron
from aihpc.interop.torchtitan import export_torchtitan, import_torchtitan

__all__ = [
    "FRAMEWORKS",
    "Imported",
    "export_deepspeed",
    "export_megatron",
    "export_torchtitan",
    "import_deepspeed",
    "import_megatron",
    "import_torchtitan",
    "model_fields",
]

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
