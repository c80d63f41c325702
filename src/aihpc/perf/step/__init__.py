"""The step model: one plan's (or an array of plans') FLOPs, parameters, memory and step time as
a sum of named terms — compute by kernel class (``compute``, ``gemm``, ``attention_kernels``,
``moe_kernels``), communication (``comm``, ``tp_overlap``, ``dp_comm``), the pipeline
(``pipeline``), host costs (``eager_host``, ``dtensor_host``, ``moe_host``), and the array
form the search prices (``plan_batch``, ``batch_*``). ``estimate`` puts them together for one
plan.

Imports ``aihpc.runspec`` only; never torch.
"""

from aihpc.perf.step.estimate import Estimate, estimate, estimate_plan
from aihpc.perf.step.memory import MemoryBreakdown, checkpoint_bytes
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams

__all__ = [
    "DEFAULT_PARAMS",
    "Estimate",
    "MemoryBreakdown",
    "ModelParams",
    "checkpoint_bytes",
    "estimate",
    "estimate_plan",
]
