"""Framework configs ⇄ run spec: Megatron-LM launch arguments, torchtitan TOML, DeepSpeed JSON,
Hugging Face config.json; and the Slurm batch script for ``aihpc train``. Never imports torch or
the frameworks."""

from aihpc.interop._common import Imported, model_fields
from aihpc.interop.deepspeed import export_deepspeed, import_deepspeed
from aihpc.interop.hf import export_hf, hf_config, import_hf
from aihpc.interop.megatron import export_megatron, import_megatron
from aihpc.interop.torchtitan import export_torchtitan, import_torchtitan

__all__ = [
    "FRAMEWORKS",
    "Imported",
    "export_deepspeed",
    "export_hf",
    "export_megatron",
    "export_torchtitan",
    "hf_config",
    "import_deepspeed",
    "import_hf",
    "import_megatron",
    "import_torchtitan",
    "model_fields",
]

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed", "hf")
