"""Hugging Face ``config.json`` ⇄ the run spec's model: ``reader`` (a config as DeepSpeed users and
``aihpc import hf`` give it), ``writer`` (the config ``aihpc export --to deepspeed`` writes beside
the JSON)."""

from aihpc.interop.hf.reader import hf_model_shape, import_hf
from aihpc.interop.hf.writer import export_hf, hf_config

__all__ = ["export_hf", "hf_config", "hf_model_shape", "import_hf"]
