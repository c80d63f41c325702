"""What DeepSpeed fixes for a run, whichever way the config goes: the [training] facts its
runtime decides (``FIXED``) and those the model code and training script decide under DeepSpeed,
not its JSON (``MODEL_CODE``: an import gives aihpc's defaults, an export names them)."""

from __future__ import annotations

from typing import Any

__all__ = ["FIXED", "FRAMEWORK", "MODEL_CODE"]

FRAMEWORK = "DeepSpeed"


FIXED: dict[str, Any] = {
    "pipeline_split": "uneven",
    "kv_repeat": False,
    "cp_exchange": "ring",
    "fp8_saved_inputs": "fp8",
    "fp8_param_gather": False,
    "pp_comm_ctas": 0,
    "cp_comm_ctas": 0,
}


# [training] fields the model code and training script decide under DeepSpeed, not its JSON:
# an import gives aihpc's defaults.
MODEL_CODE = ("attention", "cross_entropy", "fused_kernels", "dropout", "seed", "optimizer_dtype")
