"""How many parameters the model has and where a plan puts them: the whole model, what one token
passes through (MoE: the top-k routed and the shared experts), each pipeline stage's share, and
what one GPU holds before ZeRO / FSDP shards it — the figure Megatron-LM prints as "number of
parameters on (tensor, pipeline) model parallel rank (0, 0)".

Stages hold layers as the memory model lays them out (``batch_memory``: the busiest stage has
ceil(L / (pp x vpp)) x vpp layers); the first stage adds the input embedding, the last the output
layer (unless tied with pp = 1), the final norm and the multi-token-prediction modules, which
the published totals leave out (DeepSeek-V3's 671B excludes its 14B MTP module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aihpc.perf.step.flops import (
    active_params,
    embedding_params,
    mtp_params,
    num_params,
    params_per_layer,
)
from aihpc.perf.step.plan_batch import layer_params_split
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan

__all__ = ["ParamCounts", "param_counts"]


@dataclass(frozen=True)
class ParamCounts:
    total: int  # the published convention: layers, embeddings, final norm; no MTP modules
    active: int  # per token; equal to total for a dense model
    first_stage: int  # the first pipeline stage's (the only stage's with pp = 1)
    last_stage: int
    # the first stage's tensor-parallel rank 0, before ZeRO / FSDP sharding (the MTP modules'
    # share left out)
    per_gpu: int

    def to_json(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "active": self.active,
            "first_stage": self.first_stage,
            "last_stage": self.last_stage,
            "per_gpu": self.per_gpu,
        }


def _stage_layers(model: ModelSpec, plan: ParallelPlan) -> int:
    chunks = plan.pp * plan.vpp
    return -(-model.num_layers // chunks) * plan.vpp


def _layers(model: ModelSpec, layers: int) -> int:
    """Parameters of ``layers`` of the model's layers, dense and MoE in the model's proportion."""
    if not model.is_moe:
        return layers * params_per_layer(model)
    moe = round(layers * model.num_moe_layers / model.num_layers)
    return (layers - moe) * params_per_layer(model) + moe * params_per_layer(model, moe=True)


def param_counts(model: ModelSpec, plan: ParallelPlan) -> ParamCounts:
    """The model's parameters: in all, per token, per pipeline stage and on one GPU."""
    emb, norm = embedding_params(model), model.hidden_size
    output = 0 if model.tied_embeddings else emb
    total = num_params(model)
    if plan.pp == 1:
        first = last = total + mtp_params(model)
    else:
        stage = _layers(model, _stage_layers(model, plan))
        first = stage + emb
        last = stage + output + norm + mtp_params(model)
    layers = _stage_layers(model, plan)
    dense, experts = layer_params_split(model, layers, plan.tp, plan.etp, plan.ep)
    edge = emb + (output if plan.pp == 1 else 0)
    per_gpu = dense + experts + edge / plan.tp + (norm if plan.pp == 1 else 0)
    return ParamCounts(total, active_params(model), first, last, round(per_gpu))
