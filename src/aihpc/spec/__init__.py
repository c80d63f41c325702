"""The shared vocabulary: typed, validated ModelSpec, ClusterSpec, ParallelPlan, TrainingSpec.

Imports nothing else of aihpc and never torch.
"""

from aihpc.spec.calibration import Calibration, load_calibration
from aihpc.spec.cluster import ClusterSpec, GPUSpec, gpu_catalog
from aihpc.spec.errors import SpecError
from aihpc.spec.model import ModelSpec, model_presets
from aihpc.spec.parallel import ParallelPlan, PartialPlan, plan_problem, validate_plan
from aihpc.spec.reliability import ReliabilitySpec
from aihpc.spec.runspec import RunSpec, load_runspec, runspec_from_dict
from aihpc.spec.training import CheckpointSpec, TrainingSpec

__all__ = [
    "Calibration",
    "CheckpointSpec",
    "ClusterSpec",
    "GPUSpec",
    "ModelSpec",
    "ParallelPlan",
    "PartialPlan",
    "ReliabilitySpec",
    "RunSpec",
    "SpecError",
    "TrainingSpec",
    "gpu_catalog",
    "load_calibration",
    "load_runspec",
    "model_presets",
    "plan_problem",
    "runspec_from_dict",
    "validate_plan",
]
