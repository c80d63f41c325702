"""One plan of a vision-language model: the language model priced by the step model (on its
GPUs, at the layout's sequence length), the encoder and projector priced per placement
(perf/multimodal/placement.py), the imbalance the image distribution brings, and the memory of
the GPU that holds both.

A frozen language model (projector-only pre-training, LLaVA's stage 1) still runs its backward
to carry gradients to the projector, without the weight-gradient GEMMs: its layer compute is
(fwd + input-gradient) / (fwd + backward) of the trained one's (FLOP shares of the GEMMs and of
the attention core, whose backward is all input gradient), and it has no gradient reduction
(ZeRO-3 still gathers its weights: 2 of the 3 collectives) and no optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from aihpc.perf.multimodal import encoder_host, loader
from aihpc.perf.multimodal import placement as pl
from aihpc.perf.multimodal.encoder import (
    encoder_activation_bytes,
    encoder_memory_bytes,
    encoder_params,
    projector_params,
)
from aihpc.perf.multimodal.imbalance import Grid
from aihpc.perf.multimodal.workload import (
    Layout,
    image_works,
    layout,
    mean_works,
    rates_for,
    sample_cost,
)
from aihpc.perf.step import deterministic_fill
from aihpc.perf.step.dtensor_host import stage_tensors
from aihpc.perf.step.estimate import Estimate, estimate_plan
from aihpc.perf.step.flops import counted_keys, layer_flops
from aihpc.perf.step.memory import GiB
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.perf.step.params_norm import params_norm_s
from aihpc.runspec.errors import SpecError
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.runspec import RunSpec
from aihpc.runspec.vision import PLACEMENTS

__all__ = ["VlmEstimate", "estimate_vlm", "frozen_llm_factor"]


@dataclass(frozen=True)
class VlmEstimate:
    placement: str
    encoder_tp: int
    encoder_gpus: int  # GPUs that run only the encoder (stage, pool); idle ones not counted
    num_gpus: int  # the cluster's
    llm: Estimate  # the language model on its GPUs
    layout: Layout
    step_time_s: float
    time_s: dict[str, float]
    samples_per_step: int
    memory_gib: float  # the most loaded GPU
    encoder_memory_gib: float  # of which the encoder and projector (weights, state, activations)
    encoder_flops_per_sample: float  # forward
    imbalance: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        # the combined memory (a frozen language model's without its gradients and optimizer)
        return self.memory_gib <= self.llm.hbm_gib - self.llm.headroom_gib

    @property
    def idle_gpus(self) -> int:
        """GPUs neither part uses (replicas that would not divide the batch)."""
        p = self.llm.plan
        return self.num_gpus - p.tp * p.pp * p.cp * p.dp - self.encoder_gpus

    @property
    def samples_per_s_per_gpu(self) -> float:
        return self.samples_per_step / self.step_time_s / self.num_gpus

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Language-model tokens (text and image) per second per GPU of the whole cluster."""
        p = self.llm.plan
        return p.global_batch_size * self.layout.llm_seq / self.step_time_s / self.num_gpus

    def to_json(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "encoder_tp": self.encoder_tp,
            "encoder_gpus": self.encoder_gpus,
            "idle_gpus": self.idle_gpus,
            "fits": self.fits,
            "step_time_s": self.step_time_s,
            "samples_per_s_per_gpu": self.samples_per_s_per_gpu,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "time_s": dict(self.time_s),
            "memory_gib": self.memory_gib,
            "encoder_memory_gib": self.encoder_memory_gib,
            "encoder_gflops_per_sample": self.encoder_flops_per_sample / 1e9,
            "samples_per_sequence": self.layout.samples_per_seq,
            "llm_seq_length": self.layout.llm_seq,
            "imbalance": dict(self.imbalance),
            "plan": self.llm.plan.as_dict(),
            "llm_gpus": self.llm.plan.tp * self.llm.plan.pp * self.llm.plan.cp * self.llm.plan.dp,
        }


def frozen_llm_factor(spec: RunSpec, seq: int) -> float:
    """A frozen language model's layer compute over a trained one's: (F + F_in) / (F + B)
    with the GEMMs' backward 2x (half of it input gradients) and the attention core's 2.5x
    forward (all input gradient; executed causal, half counted)."""
    lf = layer_flops(spec.model, 1, counted_keys(spec.model, seq))
    g, a = lf.gemm, lf.attn_core / 2
    return (2 * g + 3.5 * a) / (3 * g + 3.5 * a)


def _llm(
    spec: RunSpec, plan: ParallelPlan, lay: Layout, gpus: int, params: ModelParams
) -> Estimate:
    model = replace(spec.model, seq_length=lay.llm_seq)
    cluster = (
        spec.cluster if gpus == spec.cluster.num_gpus else replace(spec.cluster, num_gpus=gpus)
    )
    return estimate_plan(model, cluster, plan, spec.training, params)


def _llm_terms(spec: RunSpec, est: Estimate, lay: Layout) -> tuple[dict[str, float], float]:
    """The language model's step terms, a frozen one's without its weight gradients."""
    t = dict(est.time_s)
    mm = spec.multimodal
    assert mm is not None
    if mm.freeze_llm:
        f = frozen_llm_factor(spec, lay.llm_seq)
        t["compute"] = t.get("compute", 0.0) * f
        t["dp_comm"] = t.get("dp_comm", 0.0) * (2 / 3 if est.plan.zero_stage == 3 else 0.0)
        t["optimizer"] = 0.0
    return t, sum(t.values())


def estimate_vlm(
    spec: RunSpec,
    plan: ParallelPlan | None = None,
    placement: str | None = None,
    encoder_tp: int | None = None,
    encoder_gpus: int | None = None,
    params: ModelParams = DEFAULT_PARAMS,
) -> VlmEstimate:
    """Price a vision-language run spec's plan with the encoder at ``placement`` (default: the
    spec's; ``auto`` there means ``tp``). ``plan`` is the language model's on its GPUs."""
    if spec.vision is None or spec.multimodal is None:
        raise SpecError("model.vision", None, "a vision-language model needs [model.vision]")
    mm = spec.multimodal
    where = placement or (mm.placement if mm.placement != "auto" else "tp")
    if where not in PLACEMENTS:
        raise SpecError("multimodal.placement", where, "allowed: " + " | ".join(PLACEMENTS))
    plan = plan or spec.plan()
    e_tp = encoder_tp or mm.encoder_tp or (plan.tp if where in ("tp", "bubble") else 1)
    if where == "replicated":
        e_tp = 1
    if where in ("tp", "bubble"):
        e_tp = plan.tp
    extra = _extra_gpus(spec, plan, where, e_tp, encoder_gpus)
    plan = _reshape(plan, spec.cluster.num_gpus - extra, where)
    if where == "stage":  # the replicas that fit, each with its encoder stage
        extra = plan.dp * e_tp
    lay = _layout(spec, plan)
    est = _llm(spec, plan, lay, plan.tp * plan.pp * plan.cp * plan.dp, params)
    return _price(spec, plan, lay, est, where, e_tp, extra, params)


def _layout(spec: RunSpec, plan: ParallelPlan) -> Layout:
    """The plan's layout: its data-parallel ranks meet at every micro-step under ZeRO-3 (every
    layer's weights gathered in every micro-step) or when a step has one micro-step."""
    assert spec.vision is not None and spec.multimodal is not None
    m = max(1, plan.global_batch_size // (plan.dp * plan.micro_batch_size))
    synced = plan.zero_stage == 3 or m == 1
    return layout(
        spec.model, spec.vision, spec.multimodal, plan.micro_batch_size, plan.dp, m, synced
    )


def _reshape(plan: ParallelPlan, gpus: int, where: str) -> ParallelPlan:
    """The language model's plan on the GPUs the encoder leaves it: the most data-parallel
    replicas that fit and divide the batch (GPUs left over stay idle, and count)."""
    if where not in ("stage", "pool"):
        return plan
    model_parallel = plan.tp * plan.pp * plan.cp
    per_step = plan.global_batch_size // plan.micro_batch_size
    dp = gpus // model_parallel
    while dp >= 1 and per_step % dp:
        dp -= 1
    if dp < 1:
        raise SpecError(
            "multimodal.placement",
            where,
            f"the language model keeps {gpus} GPUs, fewer than one replica of tp x pp x cp = "
            f"{model_parallel}",
        )
    return replace(plan, dp=dp)


def _extra_gpus(spec: RunSpec, plan: ParallelPlan, where: str, e_tp: int, gpus: int | None) -> int:
    """GPUs taken from the language model for the encoder."""
    mm = spec.multimodal
    assert mm is not None
    if where == "stage":  # each replica's pipeline gains a stage of e_tp GPUs
        mp = plan.tp * plan.pp * plan.cp
        return (spec.cluster.num_gpus // (mp + e_tp)) * e_tp
    if where == "pool":
        g = gpus or mm.encoder_gpus or max(e_tp, spec.cluster.num_gpus // 8)
        if g >= spec.cluster.num_gpus:
            raise SpecError("multimodal.encoder_gpus", g, "must leave GPUs for the language model")
        return g
    if where == "bubble" and plan.pp < 2:
        raise SpecError("multimodal.placement", "bubble", "needs pipeline parallelism (pp >= 2)")
    return 0


def _price(
    spec: RunSpec,
    plan: ParallelPlan,
    lay: Layout,
    est: Estimate,
    where: str,
    e_tp: int,
    extra: int,
    params: ModelParams,
) -> VlmEstimate:
    v, mm = spec.vision, spec.multimodal
    assert v is not None and mm is not None
    llm_t, llm_step = _llm_terms(spec, est, lay)
    samples_mb = plan.micro_batch_size * lay.samples_per_seq
    m = plan.global_batch_size // (plan.dp * plan.micro_batch_size)
    enc_trained, proj_trained = not mm.freeze_encoder, not mm.freeze_projector
    rates = rates_for(v, spec.model, mm, spec.cluster, spec.training, params, e_tp, samples_mb)
    sample = sample_cost(v, mm, rates, enc_trained, proj_trained)
    kernels_mb = sample.times(samples_mb)
    host_mb = encoder_host.micro_batch_host_s(v, mm, spec.training, params)
    host_mb += sum(encoder_host.fsdp_gather_host_s(v, mm, plan, spec.training, spec.cluster.gpu))
    mb = encoder_host.with_host(kernels_mb, host_mb, spec.cluster.gpu)
    terms = _placement_terms(spec, plan, lay, est, where, e_tp, extra, mb, sample, llm_step, m)
    time_s = {**llm_t, "encoder": terms.encoder, "encoder_imbalance": terms.imbalance}
    time_s["encoder_fill"] = terms.fill + terms.transfer
    time_s["cross_attention"] = _cross_attention_s(spec, plan, lay, est, m)
    extra_terms, forward_s = _encoder_step_terms(spec, plan, where, rates, samples_mb, m, params)
    time_s |= extra_terms
    time_s["params_norm"] = _params_norm_s(spec, plan, est, where, e_tp, params)
    tokens = m * plan.micro_batch_size * lay.llm_seq / plan.cp  # the rank's, a step
    full = plan.recompute == "full"
    layers = spec.model.num_layers // plan.pp
    time_s["deterministic_fill"] = deterministic_fill.fill_s(
        spec.model, tokens, layers, plan.tp, m, full, spec.cluster.gpu, spec.training, params
    )
    step = sum(time_s.values())
    if mm.image_processor != "none":  # the data loader's host time (loader.py)
        samples_rank = plan.global_batch_size * lay.samples_per_seq // plan.dp
        host = loader.loader_step_s(v, mm, samples_rank, plan.dp)
        time_s["data_loader"] = loader.loader_visible_s(host, mm.loader_workers, step)
        step += time_s["data_loader"]
    works = image_works(v, mm)
    mean = mean_works(works)
    flops = mean.flops_fwd(v, spec.model.hidden_size) * mm.images_per_sample.mean
    enc_mem = _encoder_memory(spec, plan, where, e_tp, mb, samples_mb, m, extra)
    llm_mem = est.memory.total
    if mm.freeze_llm:  # 16-bit weights only: no gradients, no optimizer state
        llm_mem -= est.memory.gradients + est.memory.optimizer
    shared = where in ("replicated", "tp", "bubble")
    mem = llm_mem + enc_mem if shared else max(llm_mem, enc_mem)
    return VlmEstimate(
        placement=where,
        encoder_tp=e_tp,
        encoder_gpus=extra,
        num_gpus=spec.cluster.num_gpus,
        llm=est,
        layout=lay,
        step_time_s=step,
        time_s=time_s,
        samples_per_step=plan.global_batch_size * lay.samples_per_seq,
        memory_gib=mem / GiB,
        encoder_memory_gib=enc_mem / GiB,
        encoder_flops_per_sample=flops,
        imbalance={
            "micro_batch_mean_s": mb.mean,
            "micro_batch_p99_s": mb.quantile(0.99),
            "step_forward_s": forward_s,
        },
    )


def _params_norm_s(
    spec: RunSpec, plan: ParallelPlan, est: Estimate, where: str, e_tp: int, params: ModelParams
) -> float:
    """``training.log_params_norm`` over what the step model's optimizer term does not hold: a
    frozen language model's parameters on the rank (its decoder's tensors as
    ``dtensor_host.stage_tensors`` counts them) and, where the encoder shares the language
    model's GPUs, the encoder's and projector's (``e_tp`` ways), each frozen or trained
    (perf/step/params_norm.py). A trained language model's is in its optimizer term."""
    v, mm, training = spec.vision, spec.multimodal, spec.training
    assert v is not None and mm is not None
    if not training.log_params_norm:
        return 0.0
    trained = frozen = 0.0
    tensors = 0
    if where in ("replicated", "tp", "bubble"):
        enc, proj = encoder_params(v) / e_tp, projector_params(v, spec.model.hidden_size) / e_tp
        trained = (0.0 if mm.freeze_encoder else enc) + (0.0 if mm.freeze_projector else proj)
        frozen = (enc if mm.freeze_encoder else 0.0) + (proj if mm.freeze_projector else 0.0)
        tensors = encoder_host.encoder_tensors(v)[0] if mm.freeze_encoder else 0
    if mm.freeze_llm and est.params is not None:
        frozen += est.params.per_gpu
        tensors += stage_tensors(spec.model.num_layers // plan.pp, plan.pp, False)[0]
    shard = plan.dp * plan.cp if plan.zero_stage >= 1 else 1
    gpu = spec.cluster.gpu
    return float(params_norm_s(trained, frozen, shard, tensors, gpu, training, params))


def _encoder_step_terms(
    spec: RunSpec,
    plan: ParallelPlan,
    where: str,
    rates: Any,
    samples_mb: int,
    m: int,
    params: ModelParams,
) -> tuple[dict[str, float], float]:
    """Where the encoder shares the language model's GPUs (replicated, tp, bubble): its blocks'
    own ZeRO-3 gathers and reduce-scatters (each block an FSDP unit) and what its parameters add
    to an eager optimizer step on a CPU host (encoder_host.py), 0 elsewhere; and the mean
    seconds of a rank's encoder forwards in a step (kernels, host issue and the gathers they
    wait on: what the trainer times around its encoder's calls)."""
    v, mm, cluster, training = spec.vision, spec.multimodal, spec.cluster, spec.training
    assert v is not None and mm is not None
    gpu = cluster.gpu
    kernels = sample_cost(v, mm, rates, not mm.freeze_encoder, not mm.freeze_projector)
    fwd_kernels = sample_cost(v, mm, rates, False, False).times(samples_mb)
    fwd_host = encoder_host.host_ops_s(v, mm, training, params)[0]
    fwd_host += encoder_host.fsdp_gather_host_s(v, mm, plan, training, gpu)[0]
    forward = m * encoder_host.with_host(fwd_kernels, fwd_host, gpu).mean
    if where not in ("replicated", "tp", "bubble"):
        return {"encoder_dp_comm": 0.0, "encoder_optimizer": 0.0}, forward
    window = params.overlap_efficiency * kernels.mean * samples_mb
    comm = encoder_host.fsdp_comm_s(v, cluster, plan, training, params, m, window)
    opt = encoder_host.optimizer_host_s(v, plan, gpu, training, params)
    return {"encoder_dp_comm": comm.exposed, "encoder_optimizer": opt}, forward + comm.forward


def _placement_terms(
    spec: RunSpec,
    plan: ParallelPlan,
    lay: Layout,
    est: Estimate,
    where: str,
    e_tp: int,
    extra: int,
    mb: Grid,
    sample: Grid,
    llm_step: float,
    m: int,
) -> pl.PlacementTerms:
    if where in ("replicated", "tp"):
        slots = (plan.pp - 1) / plan.vpp if plan.pp > 1 else 0.0
        return pl.first_stage(mb, m, plan.dp, slots)
    if where == "stage":
        busy = est.time_s.get("compute", 0.0) + est.time_s.get("recompute", 0.0)
        slot = busy / max(1, m)
        return pl.own_stage(mb, m, plan.dp, slot)
    if where == "bubble":
        mm = spec.multimodal
        assert mm is not None and spec.vision is not None
        fwd = _forward_only(spec, e_tp, plan.micro_batch_size * lay.samples_per_seq)
        bubble = est.time_s.get("pipeline_bubble", 0.0)
        return pl.in_bubbles(mb, fwd, m, plan.dp, plan.pp, bubble)
    return _pool_terms(spec, plan, lay, e_tp, extra, llm_step, m)


def _forward_only(
    spec: RunSpec, e_tp: int, samples: int, params: ModelParams = DEFAULT_PARAMS
) -> float:
    """Mean forward seconds of a micro-batch's images."""
    v, mm = spec.vision, spec.multimodal
    assert v is not None and mm is not None
    rates = rates_for(v, spec.model, mm, spec.cluster, spec.training, params, e_tp, samples)
    return sample_cost(v, mm, rates, False, False).mean * samples


def _pool_terms(
    spec: RunSpec, plan: ParallelPlan, lay: Layout, e_tp: int, gpus: int, llm_step: float, m: int
) -> pl.PlacementTerms:
    v, mm = spec.vision, spec.multimodal
    assert v is not None and mm is not None
    samples_step = plan.global_batch_size * lay.samples_per_seq
    images = samples_step * mm.images_per_sample.mean
    per_gpu = max(1.0, images / gpus)
    rates = rates_for(
        v,
        spec.model,
        mm,
        spec.cluster,
        spec.training,
        DEFAULT_PARAMS,
        e_tp,
        per_gpu / max(1e-9, mm.images_per_sample.mean),
    )
    works = image_works(v, mm)
    trained = not mm.freeze_encoder
    costs = [rates.image_s(w, trained, not mm.freeze_projector) for w, _ in works]
    img = Grid.of(costs, [q for _, q in works])
    pool_gpus = max(1, gpus // e_tp)
    first = img.mean * mm.images_per_sample.mean * plan.micro_batch_size * lay.samples_per_seq
    tokens = mean_works(works).lm_tokens * mm.images_per_sample.mean * lay.samples_per_seq
    moved = pl.embedding_transfer_s(
        spec.cluster, tokens * plan.micro_batch_size, spec.model.hidden_size, trained
    )
    return pl.pool(img, images, pool_gpus, llm_step, first, moved)


def _cross_attention_s(
    spec: RunSpec, plan: ParallelPlan, lay: Layout, est: Estimate, m: int
) -> float:
    """Cross-attention layers (Llama 3.2 Vision): their K/V projections over the image tokens
    and the text-to-image attention, beyond what pricing them as self-attention over the
    text counted; spread over the stages, at the layer GEMMs' achieved rate."""
    v, mm = spec.vision, spec.multimodal
    assert v is not None and mm is not None
    if not v.cross_attention_layers:
        return 0.0
    img = mean_works(image_works(v, mm)).lm_tokens * mm.images_per_sample.mean
    text = mm.text_tokens.mean
    d = spec.model.kv_channels
    per_sample = 2 * 2 * img * spec.model.hidden_size * spec.model.kv_heads * d
    per_sample += 4 * spec.model.hidden_size * text * img
    flops = 3 * per_sample * v.cross_attention_layers * plan.micro_batch_size * lay.samples_per_seq
    rate = est.model_tflops_per_gpu * 1e12
    return m * flops / plan.tp / plan.pp / max(rate, 1.0)


def _encoder_memory(
    spec: RunSpec,
    plan: ParallelPlan,
    where: str,
    e_tp: int,
    mb: Grid,
    samples: int,
    m: int,
    extra: int,
) -> float:
    """The encoder's bytes on the GPU that holds it: weights and state (sharded as the plan's
    ZeRO stage shards), and a trained encoder's activations for the micro-batches in flight on
    its stage (min(p, m) under 1F1B), sized at the 99th-percentile micro-batch; a pool GPU
    keeps its whole share of the step's images until their gradients come back."""
    v, mm = spec.vision, spec.multimodal
    assert v is not None and mm is not None
    tp = 1 if where == "replicated" else e_tp
    shards = plan.dp * plan.cp
    split = plan.pp if where == "bubble" else 1
    state = encoder_memory_bytes(
        v,
        spec.model.hidden_size,
        tp * split,
        shards,
        plan.zero_stage,
        not mm.freeze_encoder,
        not mm.freeze_projector,
    )
    if mm.freeze_encoder:
        return state
    works = image_works(v, mm)
    mean_img = mean_works(works)
    scale = mb.quantile(0.99) / max(mb.mean, 1e-30)
    patches = mean_img.patches * mm.images_per_sample.mean * samples * scale
    in_flight = min(plan.pp, m) if where in ("replicated", "tp") else 1
    if where == "pool":  # the step's images spread over the pool's extra / e_tp replicas
        in_flight = m * plan.dp / max(1, extra // e_tp) / scale
    acts = encoder_activation_bytes(v, patches, tp, mm.encoder_recompute) * in_flight / split
    return state + acts
