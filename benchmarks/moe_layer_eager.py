"""An eager MoE block at the small-expert MoE rows' per-GPU shapes on one GPU, against the model.

    python benchmarks/moe_layer_eager.py [--results DIR]          # needs a CUDA GPU

The MoE development set's worst rows (H08, H09, H12, H13; moe_expert_gemms.py says why these)
run eager Megatron-Core layers. moe_expert_gemms.py times their routed-expert GEMMs alone; this
times the whole routed part of one layer as an eager PyTorch program runs it, the trainer's own
block (aihpc.runtime.moe with the aihpc.comm dispatcher, no communication on one GPU): the
router over all of the row's experts (its GEMM, softmax and top-k), the gate weights, the
permutation of the token copies to this GPU's local experts (its count read on the host, as
every eager dispatcher does), the local experts' SwiGLU GEMMs (one launch per expert, Megatron's
``per_expert``, and one ``grouped_mm`` per projection), and the weighted unpermute, forward and
backward, in BF16. The routing is balanced by force (each expert takes the same number of
copies), as the published runs' benchmarks force it; the copies per GPU are the plan's
(``compute.routed_tokens``).

For each row and expert compute it reports the wall time of forward + backward (what a step
pays), the GPU's kernel time inside it (profiler) and so the time the GPU sat idle waiting on the
host, and the kernels launched; beside them, the model's GPU time for the same work on this
GPU's catalog entry in BF16 (router and expert GEMMs of ``routed_expert_gemms``, their
element-wise traffic as ``elementwise_times`` prices it). Kernel time well above the model's
says the work is mispriced; idle time says an eager host of this kind holds the layer back by
that much. It is this project's block, not Megatron's (fused permute and TE GroupedLinear), so
it bounds what eager PyTorch costs rather than reproducing the rows' software. Writes
moe_layer_eager.json/.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any

from _common import add_results_arg, catalog_gpu, machine, save
from moe_expert_gemms import ROWS, shapes

from aihpc.perf.step.gemm import stream_time_s
from aihpc.perf.step.moe_kernels import routed_expert_gemms
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.cluster import gpu_from_id

COMPUTE = {"loop": "per_expert", "grouped_mm": "grouped"}  # ours -> training.moe_expert_gemm


def tokens_per_gpu(s: dict[str, Any]) -> int:
    spec = s["spec"]
    plan = spec.plan()
    return round(plan.micro_batch_size * spec.model.seq_length / (plan.cp * plan.tp))


def model_ms(s: dict[str, Any], gpu_id: str, compute: str) -> tuple[float, float]:
    """(forward, backward) ms of the routed part of one MoE layer on ``gpu_id`` in BF16: router
    and expert GEMMs plus their element-wise bytes (5 kernels forward, 10 backward, as
    ``compute.elementwise_times`` prices an MoE layer's)."""
    spec, p = s["spec"], DEFAULT_PARAMS
    gpu = gpu_from_id(gpu_id)
    training = dataclasses.replace(
        spec.training, precision="bf16", moe_expert_gemm=COMPUTE[compute]
    )
    fwd, bwd, moved = routed_expert_gemms(spec.model, gpu, spec.plan(), training, p, None)
    fwd += stream_time_s(moved, gpu, p, kernels=5)
    bwd += stream_time_s(2 * moved, gpu, p, kernels=10)
    return fwd * 1e3, bwd * 1e3


def balanced_choice(tokens: int, top_k: int, experts: int, device: Any):
    """(tokens, top_k) expert ids, distinct per token, every expert chosen equally often when
    tokens x top_k is a multiple of ``experts`` (token t takes experts t*k .. t*k+k-1 mod E)."""
    import torch

    t = torch.arange(tokens, device=device).unsqueeze(1) * top_k
    return (t + torch.arange(top_k, device=device)) % experts


def routed_block(
    dim: int,
    ffn: int,
    num_experts: int,
    local: int,
    top_k: int,
    tokens: int,
    compute: str,
    device: Any,
    dtype: Any,
):
    """(forward closure, its input, the block): the routed part of one MoE layer for one GPU
    holding ``local`` experts, the router scoring all ``num_experts``; each call returns the
    combined output (tokens, dim)."""
    import torch
    import torch.nn.functional as F

    from aihpc.runtime.moe import MoE, MoEConfig

    cfg = MoEConfig(
        dim=dim, num_experts=local, top_k=top_k, expert_ffn_dim=ffn, expert_compute=compute
    )
    block = MoE(cfg).to(device=device, dtype=dtype)
    gate = torch.nn.Parameter(torch.randn(num_experts, dim, device=device, dtype=dtype) * 0.02)
    x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    idx = balanced_choice(tokens, top_k, local, device)

    def forward() -> torch.Tensor:
        scores = F.linear(x.float(), gate.float()).softmax(dim=-1)
        scores.topk(top_k, dim=-1)  # the router's choice, computed as it is, then overridden
        w = scores.gather(1, idx)  # the forced choice's gate weights (router gets gradients)
        w = w / w.sum(dim=-1, keepdim=True)
        routed = block.dispatcher.dispatch(x, idx, w)
        y = block.experts(routed.x, routed.tokens_per_expert)
        return block.dispatcher.combine(y, routed.handle, routed.weights).to(dtype)

    block.gate = gate  # type: ignore[attr-defined]
    return forward, x, block


def _kernel_time(step) -> tuple[float | None, int | None, list[tuple[str, float, int]]]:
    """(GPU kernel ms, kernels, the 12 costliest kernel names with their ms and count) of one
    ``step()`` from torch's profiler; (None, None, []) if the profiler cannot read the device."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    except (RuntimeError, AttributeError) as exc:
        print(f"profiler: {exc}", file=sys.stderr)
        return None, None, []
    if not kernels:
        return None, None, []
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.time_range.elapsed_us() / 1e3)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    busy = sum(sum(v) for v in by_name.values())
    return busy, len(kernels), [(n, round(sum(v), 4), len(v)) for n, v in top]


def measure(s: dict[str, Any], compute: str, iters: int = 10) -> dict[str, Any]:
    import torch

    model, plan = s["spec"].model, s["spec"].plan()
    forward, x, block = routed_block(
        model.hidden_size,
        model.expert_ffn_hidden_size // plan.etp,
        model.num_experts,
        s["local_experts"],
        model.moe_top_k,
        tokens_per_gpu(s),
        compute,
        "cuda",
        torch.bfloat16,
    )
    dy = torch.randn_like(x)
    params = [x, block.gate, *block.experts.parameters()]

    def step() -> None:
        out = forward()
        out.backward(dy)
        for p in params:
            p.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    walls, fwds, bwds = [], [], []
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    for _ in range(iters):
        t0 = time.perf_counter()
        ev[0].record()
        out = forward()
        ev[1].record()
        out.backward(dy)
        ev[2].record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        fwds.append(ev[0].elapsed_time(ev[1]))
        bwds.append(ev[1].elapsed_time(ev[2]))
        for p in params:
            p.grad = None
    busy, kernels, top = _kernel_time(step)
    wall = statistics.median(walls)
    return {
        "compute": compute,
        "wall_ms": wall,
        "fwd_ms": statistics.median(fwds),
        "bwd_ms": statistics.median(bwds),
        "kernel_ms": busy,
        "idle_ms": None if busy is None else wall - busy,
        "kernels": kernels,
        "top_kernels": top,
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| row | local experts | tokens | rows / expert | compute | model fwd+bwd ms | "
        "wall fwd+bwd ms | fwd / bwd ms (events) | kernel ms | GPU idle ms | kernels | "
        "kernel / model | wall / model |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        model = r["model_fwd_ms"] + r["model_bwd_ms"]
        k = r["kernel_ms"]

        def f(v: float | None, spec: str = ".2f") -> str:
            return "n/a" if v is None else format(v, spec)

        lines.append(
            f"| {r['id']} | {r['local_experts']} | {r['tokens']:,} | {r['rows_per_expert']:,} | "
            f"{r['compute']} | {model:.2f} | {r['wall_ms']:.2f} | "
            f"{r['fwd_ms']:.2f} / {r['bwd_ms']:.2f} | {f(k)} | {f(r['idle_ms'])} | "
            f"{f(r['kernels'], 'd')} | {f(None if k is None else k / model)} | "
            f"{r['wall_ms'] / model:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_arg(ap)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("moe_layer_eager.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu_id = catalog_gpu()
    results = []
    for row_id in args.rows:
        s = shapes(row_id)
        for compute in COMPUTE:
            fwd, bwd = model_ms(s, gpu_id, compute)
            r = {k: v for k, v in s.items() if k not in ("spec", "projections")}
            r.update(tokens=tokens_per_gpu(s), model_fwd_ms=fwd, model_bwd_ms=bwd)
            try:
                r.update(measure(s, compute, args.iters))
            except (RuntimeError, TypeError, AttributeError) as exc:  # e.g. no grouped_mm
                print(f"{row_id} {compute}: {exc}", file=sys.stderr)
                continue
            finally:
                torch.cuda.empty_cache()
            results.append(r)
            print(table(results[-1:]).splitlines()[-1], flush=True)
    device = torch.cuda.get_device_name()
    data = {"machine": machine(), "device": device, "gpu": gpu_id, "rows": results}
    note = (
        f"Measured on {device} in BF16 whatever the row's precision; model: the same work priced "
        f"for the catalog's {gpu_id} in BF16. GPU idle = wall - kernel time (profiler)."
    )
    save("moe_layer_eager", data, table(results) + "\n\n" + note, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
