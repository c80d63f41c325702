"""The RL step model against published RL runs (``aihpc validate --rl``).

``data/validation/rl_runs.csv``: one measured RL step per row (its source named on the row),
the run spec built from its columns, the predicted step against the measured one. ``set`` is
``dev`` (the rows the model was developed on) or ``heldout`` (priced once, after; never tuned).
``batching`` (optional; ``packed`` where absent): how the row's recipe formed the update's and
log-prob passes' micro-batches (perf/rl/batching.py): ``packed`` where it left
``policy.sequence_packing`` enabled (NeMo-RL's default), ``padded`` where it turned it off.
``unpadded`` where a verl row ran without dynamic batching (its fixed ``train_mbs`` sequences a
micro-batch, padding removed). ``train_mbs`` (optional; empty: 1): the plan's micro-batch size
(``parallel.micro_batch_size``): with ``packed`` the bins hold ``train_mbs`` x (prompt + the
response cap) tokens, with ``unpadded`` a micro-batch holds ``train_mbs`` sequences.
``moe_stack`` and ``cuda_graphs`` (optional, empty: not stated): the row's ``[training]`` facts
(runspec/training.py). Every NeMo-RL recipe here trains on Megatron-Core with its alltoall token
dispatcher (``policy.megatron_cfg.moe_token_dispatcher_type`` "alltoall" in v0.6's defaults; the
Megatron-Bridge Qwen3 MoE and DeepSeek providers' default before it; DeepEP off) and captures no
CUDA graph in training (no recipe names one), so the MoE rows say ``megatron-alltoall`` and every
row ``none``. ``offload_optimizer_for_logprob`` (optional, true | false): the row's
``rl.offload_optimizer_for_logprob``, true on the v0.3/v0.4 rows (NeMo-RL's
``prepare_for_lp_inference`` moved the optimizer state to host memory in every placement
through v0.4.0; perf/rl/switch.py). ``kl`` (optional, true | false; empty: the spec's
default, true): whether the run had a KL term, so a reference log-prob pass.
``rollout_cuda_graphs`` (optional, true | false; empty: true): whether the rollout engine replayed
its decode steps as CUDA graphs, the negation of the recipe's vLLM ``enforce_eager`` (false in
NeMo-RL's grpo_math_1B.yaml, v0.3.0-v0.6.0, which every NeMo-RL row's recipe inherits; verl's
rollout.yaml default True until 2025-08-08, which no verl row's launch script overrides).

``offload`` (optional; empty: the spec's default, ``nemo-rl``): the row's ``rl.offload``, whose
code moved the training state through host memory (perf/rl/switch.py): ``verl-megatron`` on the
verl rows, whose launch scripts set ``offload=True`` for the actor's ``megatron.param_offload``,
``optimizer_offload`` and ``grad_offload`` (verl's moves inside its old_log_prob and update_actor
phases).

``variable_seq_lengths`` (optional, true | false; empty: false): Megatron's flag of that name,
true on every verl row (verl's Megatron config always sets it: verl/utils/megatron_utils.py,
verl/models/mcore/config_converter.py at d26a913): under pipeline parallelism each micro-batch
crosses the stages at its own length, not padded to the step's longest as NeMo-RL's are.

``rollout_max_num_seqs`` (optional; empty: as many as the KV cache holds): the most sequences
one vLLM engine ran at once, vLLM's ``max_num_seqs`` as the row's code left it, read from the
code, not the rows. No NeMo-RL release sets it (``max_num_seqs`` appears nowhere in ``nemo_rl/``
at v0.3.0-v0.6.0; ``policy.generation.vllm_kwargs`` is empty in every recipe priced here), so
vLLM's default decides: on GPUs of >= 70 GiB (H100, GB200) 1024 through the ``vllm.LLM`` class
(``async_engine: false``) and in vLLM 0.9.0 (NeMo-RL v0.3.0) whatever the engine; from vLLM
0.10.0 (NeMo-RL v0.4.0: 0.10.0, v0.5.0: 0.11.2, v0.6.0: 0.17.1) ``AsyncLLM.from_engine_args``
without a usage context (``vllm_worker_async.py``, every recipe with ``vllm_cfg.async_engine:
true``: all DeepSeek-V3 and Qwen3-235B recipes and every asynchronous one) takes
``UsageContext.ENGINE_CONTEXT``, which vLLM's ``get_batch_defaults`` table lacks, and falls
back to the scheduler's 128 (NeMo-RL PR #4221, open, reads the same: "max_num_seqs | 128"
against 1024). verl at 588f972 passes no ``max_num_seqs`` to vLLM (<= 0.8.5, whose default is
1024 on >= 70 GiB in its V1 engine, 256 in V0; the rows' engine version is not known: 1024
priced).

``data/validation/rl_runs_other.csv``: the same columns, the measured steps of frameworks other
than NeMo-RL (verl), all held out; ``aihpc validate --rl`` prices both files.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from aihpc.perf.rl.step import estimate_rl
from aihpc.runspec.errors import SpecError
from aihpc.runspec.runspec import runspec_from_dict

__all__ = [
    "PhaseRow",
    "RLRow",
    "RLValidation",
    "RefitRow",
    "rl_runspec",
    "validate_phases",
    "validate_refit",
    "validate_rl",
]

_INTS = (
    "num_gpus",
    "rollout_gpus",
    "staleness",
    "prompts_per_step",
    "samples_per_prompt",
    "prompt_len",
    "response_len",
    "max_response_len",
    "rollout_tp",
    "train_tp",
    "train_cp",
    "train_ep",
    "train_pp",
    "train_gbs",
)


# Optional columns that are [training] fields of the row's run spec (empty: not stated).
_TRAINING = ("moe_stack", "cuda_graphs")


DEFAULT_FILES = ("rl_runs.csv", "rl_runs_other.csv")


def _default_csv(name: str = "rl_runs.csv") -> Path:
    return Path(str(resources.files("aihpc.perf.fit") / "data" / "validation" / name))


def _flag(row: dict[str, str], column: str) -> bool:
    value = row[column].strip().lower()
    if value not in ("true", "false"):
        raise SpecError(f"rl_runs.csv row {row.get('id')}: {column}", value, "true | false")
    return value == "true"


def rl_runspec(row: dict[str, str]) -> dict[str, Any]:
    """The run spec (as TOML tables) of one row."""
    v = {k: int(row[k]) for k in _INTS}
    rl: dict[str, Any] = {
        "prompts_per_step": v["prompts_per_step"],
        "samples_per_prompt": v["samples_per_prompt"],
        "prompt_len": v["prompt_len"],
        "response_len": v["response_len"],
        "max_response_len": v["max_response_len"],
        "placement": row["placement"],
        "staleness": v["staleness"],
        "rollout": {
            "tp": v["rollout_tp"],
            "gpu_memory_utilization": float(row["gpu_memory_utilization"]),
        },
    }
    if row["placement"] == "disaggregated":
        rl["rollout_gpus"] = v["rollout_gpus"]
    if (row.get("rollout_cuda_graphs") or "").strip():  # vLLM's enforce_eager, negated
        rl["rollout"]["cuda_graphs"] = _flag(row, "rollout_cuda_graphs")
    seqs = (row.get("rollout_max_num_seqs") or "").strip()
    if seqs:  # vLLM's max_num_seqs in effect (the docstring)
        rl["rollout"]["max_num_seqs"] = int(seqs)
    if row.get("weight_sync"):  # the refit the run used (auto where the column is absent)
        rl["weight_sync"] = row["weight_sync"]
    if (row.get("kl") or "").strip():  # a run without a KL term has no reference pass
        rl["kl"] = _flag(row, "kl")
    offload = (row.get("offload_optimizer_for_logprob") or "").strip()
    if offload:  # NeMo-RL through v0.4.0 moved the optimizer out for the log-prob passes
        rl["offload_optimizer_for_logprob"] = _flag(row, "offload_optimizer_for_logprob")
    if (row.get("offload") or "").strip():  # whose code moved the training state
        rl["offload"] = row["offload"].strip()
    if (row.get("batching") or "").strip():  # how its micro-batches were formed
        rl["batching"] = row["batching"].strip()
    if (row.get("variable_seq_lengths") or "").strip():  # verl's and slime's Megatron flag
        rl["variable_seq_lengths"] = _flag(row, "variable_seq_lengths")
    parallel = {
        "tp": v["train_tp"],
        "cp": v["train_cp"],
        "ep": v["train_ep"],
        "pp": v["train_pp"],
        "global_batch_size": v["train_gbs"],
        "recompute": row["recompute"],
    }
    if (row.get("train_mbs") or "").strip():
        parallel["micro_batch_size"] = int(row["train_mbs"])
    training = {k: row[k].strip() for k in _TRAINING if (row.get(k) or "").strip()}
    spec = {
        "model": {"preset": row["model"]},
        "cluster": {"gpu": row["gpu"], "num_gpus": v["num_gpus"]},
        "parallel": parallel,
        "rl": rl,
    }
    return spec | ({"training": training} if training else {})


@dataclass(frozen=True)
class RLRow:
    id: str
    set: str
    measured_s: float
    predicted_s: float
    phases_s: dict[str, float]
    source: str
    # the colocated moves' seconds under each step timer (NeMo-RL's or verl's: perf/rl/switch.py)
    switch_by_timer: dict[str, float] = field(default_factory=dict)

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "set": self.set,
            "measured_step_s": self.measured_s,
            "predicted_step_s": self.predicted_s,
            "error": self.error,
            "phases_s": self.phases_s,
            "switch_s_by_timer": self.switch_by_timer,
            "source": self.source,
        }


@dataclass(frozen=True)
class RLValidation:
    rows: list[RLRow]

    def mape(self, which: str | None = None) -> float:
        rows = [r for r in self.rows if which is None or r.set == which]
        return sum(abs(r.error) for r in rows) / len(rows) if rows else 0.0

    def worst(self, which: str | None = None) -> float:
        rows = [r for r in self.rows if which is None or r.set == which]
        return max((abs(r.error) for r in rows), default=0.0)

    def to_json(self) -> dict[str, Any]:
        sets = sorted({r.set for r in self.rows})
        return {
            "rows": [r.to_json() for r in self.rows],
            "mape": {s: self.mape(s) for s in sets} | {"all": self.mape()},
            "worst": {s: self.worst(s) for s in sets} | {"all": self.worst()},
        }


def validate_rl(path: str | Path | None = None, which: str | None = None) -> RLValidation:
    """Price every row of the RL runs CSV (``which``: only the rows of that set). By default the
    project's two files: NeMo-RL's runs (rl_runs.csv) and other frameworks' (rl_runs_other.csv,
    all held out)."""
    paths = [Path(path)] if path is not None else [_default_csv(n) for n in DEFAULT_FILES]
    table = []
    for p in paths:
        with open(p, newline="", encoding="utf-8") as f:
            table += [(p, row) for row in csv.DictReader(f)]
    rows = []
    for path, row in table:
        if which is not None and row["set"] != which:
            continue
        try:
            spec = runspec_from_dict(rl_runspec(row))
        except (KeyError, ValueError) as err:
            if isinstance(err, SpecError):
                raise SpecError(
                    f"{path.name} row {row.get('id')}: {err.field}", err.value, err.allowed
                ) from None
            raise SpecError(str(path.name), row.get("id"), f"bad row: {err}") from None
        est = estimate_rl(spec)  # the row's batching is its spec's rl.batching
        rows.append(
            RLRow(
                row["id"],
                row["set"],
                float(row["measured_step_s"]),
                est.step_time_s,
                est.phases_s,
                row["source"],
                est.switch_by_timer,
            )
        )
    return RLValidation(rows)


@dataclass(frozen=True)
class RefitRow:
    """One measured weight sync (refit): the training layout to the rollout layout."""

    id: str
    measured_low_s: float
    measured_high_s: float
    predicted_s: float
    source: str

    @property
    def error(self) -> float:
        """Relative distance of the prediction from the measured range (0 inside it)."""
        if self.predicted_s < self.measured_low_s:
            return (self.predicted_s - self.measured_low_s) / self.measured_low_s
        if self.predicted_s > self.measured_high_s:
            return (self.predicted_s - self.measured_high_s) / self.measured_high_s
        return 0.0

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "error": self.error}


def validate_refit() -> list[RefitRow]:
    """The weight-sync phase alone against NeMo-RL's measured refits (rl_refit.csv)."""
    from aihpc.perf.rl.phases import sync_s

    with open(_default_csv("rl_refit.csv"), newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    out = []
    for row in table:
        train, rollout = int(row["train_gpus"]), int(row["rollout_gpus"])
        spec = runspec_from_dict(
            {
                "model": {"preset": row["model"]},
                "cluster": {"gpu": row["gpu"], "num_gpus": train + rollout},
                "parallel": {"global_batch_size": 1},
                "rl": {
                    "prompts_per_step": 1,
                    "samples_per_prompt": 2,
                    "prompt_len": 1,
                    "response_len": 1,
                    "placement": "disaggregated",
                    "rollout_gpus": rollout,
                    "rollout": {"tp": int(row["rollout_tp"])},
                },
            }
        )
        assert spec.rl is not None
        predicted = sync_s(spec.model, spec.cluster, spec.rl, train)
        low, high = float(row["measured_low_s"]), float(row["measured_high_s"])
        out.append(RefitRow(row["id"], low, high, predicted, row["source"]))
    return out


# A published phase breakdown's names -> the step model's phases (each a sum of these).
PHASES = {
    "generation": ("rollout",),
    "training": ("update",),
    "logprobs": ("old_logprob", "ref_logprob"),
    "refit": ("weight_sync",),
}
# ... plus the colocated switch's copies made under the NeMo-RL timer a published phase is
# (perf/rl/switch.py): the blog's "refit" is the step's prepare_for_generation (the optimizer's
# offload, the engine's wake, the refit, the parameters' offload); its "generation" ends with
# the engine's sleep.
PHASE_TIMERS = {"generation": ("generation",), "refit": ("prepare_for_generation",)}


@dataclass(frozen=True)
class PhaseRow:
    """One published step's phases (rl_phases.csv) beside the step model's, in seconds."""

    id: str
    measured: dict[str, float]
    predicted: dict[str, float]
    source: str

    def error(self, phase: str) -> float:
        return (self.predicted[phase] - self.measured[phase]) / self.measured[phase]

    def to_json(self) -> dict[str, Any]:
        errors = {k: self.error(k) for k in self.measured}
        return {**self.__dict__, "error": errors}


def validate_phases(runs: str | Path | None = None) -> list[PhaseRow]:
    """Each phase of the steps whose breakdown is published (rl_phases.csv, its rows named by
    their id in the runs CSV) against the step model's phase: which phase a miss is in."""
    with open(_default_csv("rl_phases.csv"), newline="", encoding="utf-8") as f:
        published = {row["id"]: row for row in csv.DictReader(f)}
    priced = {r.id: r for r in validate_rl(runs).rows}
    out = []
    for rid, row in published.items():
        if rid not in priced:
            continue
        measured = {k: float(row[f"{k}_s"]) for k in PHASES}
        phases, timers = priced[rid].phases_s, priced[rid].switch_by_timer
        predicted = {k: sum(phases.get(p, 0.0) for p in parts) for k, parts in PHASES.items()}
        for k, names in PHASE_TIMERS.items():
            predicted[k] += sum(timers.get(t, 0.0) for t in names)
        out.append(PhaseRow(rid, measured, predicted, row["source"]))
    return out
