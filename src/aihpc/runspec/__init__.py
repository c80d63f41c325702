"""The shared vocabulary: typed, validated ModelSpec, ClusterSpec, ParallelPlan, TrainingSpec.

Imports nothing else of aihpc and never torch.
"""

from aihpc.runspec.calibration import Calibration, load_calibration
from aihpc.runspec.cluster import ClusterSpec, GPUSpec, gpu_catalog
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec, model_presets
from aihpc.runspec.parallel import ParallelPlan, PartialPlan, plan_problem, validate_plan
from aihpc.runspec.reliability import ReliabilitySpec
from aihpc.runspec.runspec import RunSpec, load_runspec, runspec_from_dict
from aihpc.runspec.training import CheckpointSpec, TrainingSpec

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
