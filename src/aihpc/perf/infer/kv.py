"""What a serving GPU holds: the weights of its share of the model, the KV cache of the
sequences it serves (paged blocks; GQA, MLA and sliding-window sizes; FP8), the activation
workspace of one engine step, and the runtime's own memory. The largest batch that fits
follows from them.

Conventions (docs/inference.md): bytes, per GPU; ``tp`` splits attention heads, dense FFNs and
the vocabulary; ``pp`` splits the layers; ``dp`` replicates attention (DeepSeek's "DP
attention"); the routed experts of an MoE layer are spread over ``ep`` GPUs of the tp x dp
group of a stage, the rest of that group splitting each expert (expert tensor parallelism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aihpc.perf.infer.software import DEFAULT_SOFTWARE, Software
from aihpc.perf.step.flops import attention_params, mlp_params
from aihpc.runspec.errors import SpecError
from aihpc.runspec.inference import KV_DTYPES, WEIGHT_DTYPES
from aihpc.runspec.model import ModelSpec

__all__ = [
    "DTYPE_BYTES",
    "ServingPlan",
    "kv_bytes_per_token",
    "kv_heads_per_gpu",
    "weight_bytes_per_gpu",
]

# Bytes per element. int4 weight-only formats (AWQ, GPTQ) keep a 16-bit scale per group of 128
# weights: 0.5 + 2 / 128.
DTYPE_BYTES = {
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 2 / 128,
    "fp32": 4.0,
}
assert set(DTYPE_BYTES) == set(WEIGHT_DTYPES) >= set(KV_DTYPES)


@dataclass(frozen=True)
class ServingPlan:
    """How one serving instance is laid out: tp x pp x dp GPUs, experts over ep of them."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    kv_dtype: str = "bf16"
    weight_dtype: str = "bf16"
    block_size: int = 16  # tokens per paged KV block (vLLM's and SGLang's default 16 / 1)
    software: Software = DEFAULT_SOFTWARE  # the engine's facts (software.py, data/engines.toml)
    # busiest GPU's routed-expert load over the mean (1: balanced routing, as DeepSeek's profile
    # and SGLang's "simulated perfect EPLB" runs; a published figure where a run gives one)
    moe_imbalance: float = 1.0

    def check(self, model: ModelSpec) -> None:
        for name in ("tp", "pp", "dp", "ep", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"inference.{name}", value, "a whole number >= 1")
        if self.kv_dtype not in KV_DTYPES:
            raise SpecError("inference.kv_dtype", self.kv_dtype, "one of " + ", ".join(KV_DTYPES))
        if self.weight_dtype not in DTYPE_BYTES:
            allowed = ", ".join(DTYPE_BYTES)
            raise SpecError("inference.weight_dtype", self.weight_dtype, f"one of {allowed}")
        heads = model.num_attention_heads
        if heads % self.tp:
            raise SpecError("inference.tp", self.tp, f"must divide num_attention_heads {heads}")
        if self.ep > 1 and not model.is_moe:
            raise SpecError("inference.ep", self.ep, f"needs an MoE model; {model.name} is dense")
        if (self.tp * self.dp) % self.ep:
            raise SpecError(
                "inference.ep",
                self.ep,
                f"must divide tp x dp = {self.tp * self.dp} (the GPUs of a pipeline stage)",
            )
        if model.is_moe and self.ep > model.num_experts:
            raise SpecError("inference.ep", self.ep, f"at most num_experts {model.num_experts}")
        if not (math.isfinite(self.moe_imbalance) and self.moe_imbalance >= 1):
            raise SpecError("inference.moe_imbalance", self.moe_imbalance, "a number >= 1")
        if self.pp > model.num_layers:
            raise SpecError("inference.pp", self.pp, f"at most num_layers {model.num_layers}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def etp(self) -> int:
        """GPUs that split one routed expert: the stage's tp x dp GPUs over ep."""
        return self.tp * self.dp // self.ep

    @property
    def weight_bytes(self) -> float:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def kv_bytes(self) -> float:
        return DTYPE_BYTES[self.kv_dtype]

    def to_json(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "ep": self.ep,
            "gpus": self.gpus,
            "kv_dtype": self.kv_dtype,
            "weight_dtype": self.weight_dtype,
            "block_size": self.block_size,
            "engine": self.software.to_json(),
            "moe_imbalance": self.moe_imbalance,
        }


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> float:
    """KV heads one GPU keeps: GQA's heads split over tp, each replicated where tp exceeds them
    (vLLM and TensorRT-LLM replicate a KV head on the tp / kv_heads ranks that share it)."""
    return max(1.0, model.kv_heads / tp)


def kv_elems_per_token_layer(model: ModelSpec, tp: int) -> float:
    """Cached elements per token and layer on one GPU: keys and values of its KV heads; MLA
    caches the compressed latent and the shared RoPE key once, on every tp rank (DeepSeek-V2
    sec. 2.1: (d_c + d_h^R) l elements per token)."""
    if model.is_mla:
        assert model.kv_lora_rank is not None and model.qk_rope_head_dim is not None
        return float(model.kv_lora_rank + model.qk_rope_head_dim)
    return 2.0 * kv_heads_per_gpu(model, tp) * model.kv_channels


def kv_bytes_per_token(model: ModelSpec, plan: ServingPlan, context: float | None = None) -> float:
    """KV-cache bytes one token of a sequence holds on one GPU over the layers of its stage.
    With ``context`` (the sequence's length), a sliding-window layer keeps only its window's
    tokens: the bytes are averaged over the sequence."""
    per_layer = kv_elems_per_token_layer(model, plan.tp) * plan.kv_bytes
    layers = model.num_layers / plan.pp
    windowed = model.windowed_layers / plan.pp
    if windowed and model.attention_window is not None and context:
        kept = min(1.0, model.attention_window / context)
        layers = layers - windowed + windowed * kept
    return per_layer * layers


def paged_tokens(length: float, block_size: int) -> float:
    """Tokens' worth of KV memory a sequence of ``length`` takes in paged blocks: its last block
    is allocated whole."""
    return math.ceil(max(length, 1.0) / block_size) * block_size


def stage_layer_counts(model: ModelSpec, pp: int) -> tuple[float, float]:
    """(dense layers, MoE layers) of the largest pipeline stage: the layers split evenly and
    rounded up, MoE and dense ones in the model's proportion."""
    per_stage = math.ceil(model.num_layers / pp)
    moe = per_stage * model.num_moe_layers / model.num_layers
    return per_stage - moe, moe


def weight_bytes_per_gpu(model: ModelSpec, plan: ServingPlan) -> float:
    """Weights one GPU of the largest stage holds: attention, norms and dense FFNs over tp;
    routed experts over ep x etp (the stage's tp x dp GPUs); shared experts and routers over
    tp; the embedding and the output layer over tp on the first and last stage (a stage holds
    the larger of the two when pp > 1, both otherwise)."""
    dense, moe = stage_layer_counts(model, plan.pp)
    h = model.hidden_size
    attn = (attention_params(model) + 2 * h) / plan.tp
    per_dense = attn + mlp_params(model, model.ffn_hidden_size) / plan.tp
    per_moe = attn
    if model.is_moe:
        expert = mlp_params(model, model.expert_ffn_hidden_size)
        per_moe += model.num_experts * expert / (plan.tp * plan.dp)
        per_moe += model.num_shared_experts * expert / plan.tp + h * model.num_experts
    embed = model.vocab_size * h / plan.tp
    ends = embed * (1 if model.tied_embeddings else 2) if plan.pp == 1 else embed
    params = dense * per_dense + moe * per_moe
    return params * plan.weight_bytes + ends * 2.0  # embedding and head stay 16-bit
