"""The runs CSV: measured training runs, one per row, as `aihpc validate --runs` and
`aihpc calibrate --runs` read them (the project's published sets use the same columns).

docs/performance-model.md ("Your own runs") lists the columns; ``aihpc validate --runs-template``
prints a filled-in example (``data/runs_template.csv``). A malformed cell is a SpecError naming
its column and value; the caller adds the file and the row.
"""

from __future__ import annotations

import csv
import io
import math
from importlib import resources
from pathlib import Path
from typing import Any

from aihpc.runspec.errors import SpecError
from aihpc.runspec.inputs import read_input
from aihpc.runspec.runspec import RunSpec, runspec_from_dict
from aihpc.runspec.training import COMM_CTA_CAPS

__all__ = [
    "MEASURED_COLUMNS",
    "RUNS_COLUMNS",
    "cell",
    "measured",
    "measured_throughput",
    "read_table",
    "row_runspec",
    "template_text",
]

PLAN_INT = (
    "tp",
    "pp",
    "vpp",
    "cp",
    "dp",
    "dp_shard",
    "zero_stage",
    "micro_batch_size",
    "global_batch_size",
)
MOE_PLAN_INT = ("ep", "etp")  # columns of moe_runs.csv only
MODEL_INT = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "vocab_size",
    "seq_length",
)

# What every runs CSV needs (docs/performance-model.md, "Your own runs"): the model as a preset
# or as its shape columns, and the measured figure as tokens/s/GPU or a step time, per row.
RUNS_COLUMNS = ("id", "gpu", "num_gpus", "global_batch_size", "precision")
MEASURED_COLUMNS = ("measured_tokens_per_s_per_gpu", "measured_step_time_s")


def cell(row: dict[str, str], key: str) -> str:
    return (row.get(key) or "").strip()


def _int(row: dict[str, str], key: str) -> int:
    text = cell(row, key)
    try:
        return int(text)
    except ValueError:
        raise SpecError(key, text, "expected a whole number") from None


def _float(row: dict[str, str], key: str) -> float:
    text = cell(row, key)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise SpecError(key, text, "expected a finite number")
    return value


def _bool(row: dict[str, str], key: str) -> bool:
    text = cell(row, key).lower()
    if text not in ("true", "false"):
        raise SpecError(key, cell(row, key), "expected true or false")
    return text == "true"


def _model_table(row: dict[str, str]) -> dict[str, Any]:
    model: dict[str, Any] = {k: _int(row, k) for k in MODEL_INT if cell(row, k)}
    if cell(row, "preset"):  # the published architecture from the preset; cells override it
        model["preset"] = cell(row, "preset")
        if cell(row, "ffn_activation"):
            model["ffn_activation"] = cell(row, "ffn_activation")
        if cell(row, "tied_embeddings"):
            model["tied_embeddings"] = _bool(row, "tied_embeddings")
        if cell(row, "moe_capacity_factor"):
            model["moe_capacity_factor"] = _float(row, "moe_capacity_factor")
    else:
        if not cell(row, "ffn_activation"):
            raise SpecError("ffn_activation", "", "gelu | swiglu | relu2 (or name a preset)")
        model["ffn_activation"] = cell(row, "ffn_activation")
        model["tied_embeddings"] = bool(cell(row, "tied_embeddings")) and _bool(
            row, "tied_embeddings"
        )
    if cell(row, "position_embedding"):
        model["position_embedding"] = cell(row, "position_embedding")
    model["name"] = cell(row, "model") or cell(row, "preset") or cell(row, "id")
    return model


def _training_table(row: dict[str, str]) -> dict[str, Any]:
    training: dict[str, Any] = {"precision": cell(row, "precision")}
    if cell(row, "attention"):
        training["attention"] = cell(row, "attention")
    for flag in ("fused_kernels", "grad_reduce_overlap", "kv_repeat", "fp8_param_gather"):
        if cell(row, flag):
            training[flag] = _bool(row, flag)
    text_facts = ("cross_entropy", "grad_reduce_dtype", "optimizer_dtype", "zero3_gather")
    text_facts += ("moe_dispatcher", "moe_dispatch_dtype", "moe_expert_gemm", "cuda_graphs")
    text_facts += ("moe_stack",)
    if cell(row, "moe_imbalance"):
        training["moe_imbalance"] = _float(row, "moe_imbalance")
    text_facts += ("cp_exchange", "pipeline_split", "fp8_saved_inputs", "tp_comm_overlap")
    for text in text_facts:
        if cell(row, text):
            training[text] = cell(row, text)
    if cell(row, "dropout"):
        training["dropout"] = _float(row, "dropout")
    for cap in COMM_CTA_CAPS:
        if cell(row, cap):
            training[cap] = _int(row, cap)
    return training


def row_runspec(row: dict[str, str]) -> RunSpec:
    """A validation row as a run spec; a malformed cell is a SpecError naming its column."""
    parallel: dict[str, Any] = {k: _int(row, k) for k in (*PLAN_INT, *MOE_PLAN_INT) if cell(row, k)}
    for key in ("moe_a2a_overlap", "pp_schedule"):
        if cell(row, key):
            parallel[key] = cell(row, key)
    if cell(row, "recompute_modules"):  # Megatron's --recompute-modules, joined by "+"
        parallel["recompute_modules"] = cell(row, "recompute_modules").split("+")
    if cell(row, "sequence_parallel"):
        parallel["sequence_parallel"] = _bool(row, "sequence_parallel")
    if cell(row, "recompute"):
        parallel["recompute"] = cell(row, "recompute")
    # Offloading is opt-in in every framework and the sources name it where a run used it, so an
    # empty cell is 0, not a free choice for the search.
    parallel["offload_layers"] = _int(row, "offload_layers") if cell(row, "offload_layers") else 0
    cluster: dict[str, Any] = {"gpu": cell(row, "gpu"), "num_gpus": _int(row, "num_gpus")}
    if cell(row, "gpus_per_node"):  # else the GPU's own node size
        cluster["gpus_per_node"] = _int(row, "gpus_per_node")
    return runspec_from_dict(
        {
            "model": _model_table(row),
            "cluster": cluster,
            "parallel": parallel,
            "training": _training_table(row),
        }
    )


def measured_throughput(row: dict[str, str], spec: RunSpec, global_batch_size: int) -> float:
    """Measured tokens/s per GPU: the column, else from the measured step time."""
    if cell(row, "measured_tokens_per_s_per_gpu"):
        return measured(row, "measured_tokens_per_s_per_gpu")
    if not cell(row, "measured_step_time_s"):
        raise SpecError(
            " or ".join(MEASURED_COLUMNS), "", "each row needs one: a finite number > 0"
        )
    step = measured(row, "measured_step_time_s")
    return global_batch_size * spec.model.seq_length / step / spec.cluster.num_gpus


def measured(row: dict[str, str], column: str) -> float:
    """A measured figure: a finite number > 0 (a 0 would divide the error by zero, and nan or
    inf would turn the MAPE into nan), else a SpecError naming the column."""
    try:
        value = float(cell(row, column))
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise SpecError(column, cell(row, column), "a measured figure must be a finite number > 0")
    return value


def read_table(path: Path, required: tuple[str, ...], what: str) -> list[dict[str, str]]:
    """Rows of a validation CSV; a missing column or an empty table is a one-line error."""
    text = read_input(path, what, "a CSV file")  # bounded in size; a BOM is dropped
    try:
        with io.StringIO(text, newline="") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if required == RUNS_COLUMNS and not any(c in header for c in MEASURED_COLUMNS):
                missing.append(" or ".join(MEASURED_COLUMNS))
            if missing:
                raise SpecError(
                    f"{what} {path}", ", ".join(missing), "required columns are missing"
                )
            rows = list(reader)
    except csv.Error as err:
        raise SpecError(f"{what} {path}", "content", f"not a CSV table ({err})") from None
    if not rows:
        raise SpecError(f"{what} {path}", "no rows", "needs at least one measured row")
    seen: set[str] = set()
    for row in rows:
        rid = cell(row, "id")
        if not rid or rid in seen:
            raise SpecError(f"{what} {path}: id", rid, "every row needs an id of its own")
        seen.add(rid)
    return rows


def template_text() -> str:
    """The runs CSV template: every documented column, two example rows from published runs."""
    return resources.files("aihpc.perf.fit").joinpath("data/runs_template.csv").read_text()
