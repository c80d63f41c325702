"""RunSpec: one TOML file with ``[model]``, ``[cluster]``, ``[parallel]``, ``[training]``.

Both engines read it: ``aihpc.perf`` (estimate, search, goodput) and ``aihpc.runtime`` (train).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aihpc.runspec._table import from_table
from aihpc.runspec.calibration import load_calibration
from aihpc.runspec.cluster import ClusterSpec, cluster_from_table
from aihpc.runspec.errors import SpecError
from aihpc.runspec.inference import InferenceSpec, inference_from_table
from aihpc.runspec.inputs import parse_toml, read_input
from aihpc.runspec.model import ModelSpec, model_from_table
from aihpc.runspec.parallel import ParallelPlan, PartialPlan, partial_from_table, resolve_plan
from aihpc.runspec.reliability import ReliabilitySpec
from aihpc.runspec.rl import RLSpec, rl_from_table
from aihpc.runspec.training import COMM_CTA_CAPS, CheckpointSpec, TrainingSpec
from aihpc.runspec.vision import MultimodalSpec, VisionSpec, multimodal_from_table, split_vision

__all__ = ["RunSpec", "load_runspec", "runspec_from_dict"]

# [inference] is read by `aihpc infer`; the training commands leave it alone.
SECTIONS = (
    "model",
    "cluster",
    "parallel",
    "training",
    "checkpoint",
    "reliability",
    "inference",
    "multimodal",
    "rl",  # an RL post-training step, read by `aihpc rl` (docs/rl.md)
)


@dataclass(frozen=True)
class RunSpec:
    model: ModelSpec
    cluster: ClusterSpec
    parallel: PartialPlan
    training: TrainingSpec = field(default_factory=TrainingSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    reliability: ReliabilitySpec = field(default_factory=ReliabilitySpec)
    path: str = ""
    rl: RLSpec | None = None  # [rl]: an RL post-training step (perf/rl prices it)
    inference: InferenceSpec = field(default_factory=InferenceSpec)  # read by aihpc infer
    # A vision-language model's encoder + projector ([model.vision]) and its data fact
    # ([multimodal]); None for a text-only model (docs/multimodal.md)
    vision: VisionSpec | None = None
    multimodal: MultimodalSpec | None = None

    def __post_init__(self) -> None:
        if self.cluster.gpu.p2p_channel_bw_GBps is None:
            for cap in COMM_CTA_CAPS:
                if getattr(self.training, cap):
                    raise SpecError(
                        f"training.{cap}",
                        getattr(self.training, cap),
                        f"GPU {self.cluster.gpu.id!r} has no p2p_channel_bw_GBps (what one NCCL "
                        "channel moves over its scale-up links): set it in [cluster.gpu_spec], "
                        "or use 0",
                    )
        if self.rl is not None:
            self.rl.check_cluster(
                self.cluster.num_gpus, self.cluster.gpus_per_node, self.parallel.global_batch_size
            )

    def plan(self) -> ParallelPlan:
        """The complete plan ``estimate`` evaluates (given fields, defaults for the rest); with
        ``[rl]``, the actor's training plan on the training pool."""
        return resolve_plan(self.parallel, self.training_cluster())

    def training_cluster(self) -> ClusterSpec:
        """The GPUs that train: the whole cluster, less a disaggregated rollout pool."""
        if self.rl is None or self.rl.placement == "colocated":
            return self.cluster
        return replace(self.cluster, num_gpus=self.rl.pools(self.cluster.num_gpus)[1])


def _table(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise SpecError(key, value, "expected a table")
    return value


def runspec_from_dict(
    data: dict[str, Any], base_dir: Path | None = None, path: str = ""
) -> RunSpec:
    for key, value in data.items():
        if key not in SECTIONS:
            raise SpecError(
                key,
                value if not isinstance(value, dict) else "[table]",
                "unknown section; allowed: " + ", ".join(SECTIONS),
            )
    if "model" not in data:
        raise SpecError("model", None, 'required: a [model] table (preset = "..." or the shape)')
    if "cluster" not in data:
        raise SpecError("cluster", None, "required: a [cluster] table (gpu, num_gpus)")
    cluster_table = _table(data, "cluster")
    calibration = None
    if "calibration" in cluster_table:
        cal = cluster_table["calibration"]
        if not isinstance(cal, str) or not cal:
            raise SpecError("cluster.calibration", cal, "expected the path of a calibration TOML")
        cal_path = Path(cal)
        if not cal_path.is_absolute() and base_dir is not None:
            cal_path = base_dir / cal_path
        calibration = load_calibration(cal_path)
    llm_table, vision = split_vision(_table(data, "model"))
    multimodal = None
    if "multimodal" in data:
        if vision is None:
            raise SpecError(
                "multimodal", "[table]", "needs a vision encoder: [model.vision] or a VLM preset"
            )
        multimodal = multimodal_from_table(_table(data, "multimodal"))
    elif vision is not None:
        multimodal = MultimodalSpec()
    return RunSpec(
        model=model_from_table(llm_table),
        cluster=cluster_from_table(cluster_table, calibration),
        parallel=partial_from_table(_table(data, "parallel")),
        training=from_table(TrainingSpec, _table(data, "training"), "training"),
        checkpoint=from_table(CheckpointSpec, _table(data, "checkpoint"), "checkpoint"),
        reliability=from_table(ReliabilitySpec, _table(data, "reliability"), "reliability"),
        path=path,
        rl=rl_from_table(_table(data, "rl")) if "rl" in data else None,
        inference=inference_from_table(_table(data, "inference")),
        vision=vision,
        multimodal=multimodal,
    )


def load_runspec(path: str | Path) -> RunSpec:
    """Read and validate a run spec; bad input raises SpecError (one line)."""
    path = Path(path)
    text = read_input(path, "RUNSPEC", "a .toml file")  # a UTF-8 BOM (Windows editors) is dropped
    data = parse_toml(text, "RUNSPEC", str(path))
    return runspec_from_dict(data, base_dir=path.parent, path=str(path))
