"""One context-parallel rank's ring attention emulated on one GPU, beside the model's time.

    python benchmarks/ring_attention_rank.py [--tokens-per-rank 32768] [--cp 2 4 8]
        [--ranks middle|extremes] [--gather] [--slack 0.05] [--out PATH]

Runs the kernels a load-balanced ring-attention rank runs (PyTorch's context parallel: head-tail
sharding, one causal block on its own chunks, then per step either its queries against the first
half of the arriving K/V or the second half of its queries against all of them; each block
merged into an fp32 output through its log-sum-exp) with FlashAttention-2 blocks
(``aten._scaled_dot_product_flash_attention``), forward and forward + backward through autograd,
with no communication: the arriving K/V are local tensors. Beside it: the model's attention time
for the same rank (``attention = "flash2"``), i.e. its causal FLOPs / cp at the catalog's FA2
efficiencies. A ratio near 1 says the kernels and merges of ring attention cost what the model
charges; what the ring's communication and synchronisation cost is not measured here. Needs a CUDA
GPU for the measurement. Writes <out>.json and <out>.md.

``--gather`` tests a lead for the torchtitan CP 4 / CP 8 misses (I08, I09) that one GPU can
test: PyTorch's all-gather rotater hands every attention call one fresh buffer of all cp ranks'
repeated-head K/V (4 GiB at CP 8 and 32K tokens a rank), and its gradient comes back as another,
on a GPU at 84 of 96 GiB. Each call then gathers into a new buffer, the blocks are views of it,
and the rank is timed twice: as is, and with a ballast that leaves the step only ``--slack``
(fraction) more than its own measured peak, so the caching allocator must free and re-map
blocks (each time synchronising the device) as it did near the limit. The table adds the time
under pressure over the time without, and the allocator's retry and cudaMalloc/cudaFree counts.

Ranks differ: rank 0 runs every later block as (half the queries x all arriving K/V), rank cp-1
as (all queries x half the K/V). The ring's exchanges keep ranks in step, so the slowest rank
sets the pace; ``--ranks extremes`` times ranks 0, cp/2 and cp-1 and reports the slowest
(``middle``, the default, times rank cp/2 alone, as the saved H200 results did).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from _common import add_results_arg, median_ms

from aihpc.perf.step import compute
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict

HEADS, HEAD_DIM = 32, 128  # Llama 3 8B, K/V repeated to every query head (torchtitan 2024)


def predicted_ms(tokens_per_rank: int, cp: int, gpu: str) -> dict:
    spec = runspec_from_dict(
        {
            "model": {"preset": "llama3-8b", "seq_length": tokens_per_rank * cp},
            "cluster": {"gpu": gpu, "num_gpus": cp, "gpus_per_node": 8},
            "parallel": {"cp": cp, "micro_batch_size": 1, "global_batch_size": 1},
            "training": {"attention": "flash2"},
        }
    )
    lt = compute.layer_times(
        spec.model, spec.cluster.gpu, spec.plan(), spec.training, DEFAULT_PARAMS
    )
    return {"fwd_ms": lt.fwd_attn * 1e3, "fwd_bwd_ms": (lt.fwd_attn + lt.bwd_attn) * 1e3}


def ring_rank(q, ks, vs, rank: int, attn):
    """Forward of rank ``rank``: ks[0], vs[0] are its own chunks, ks[i], vs[i] step i's."""
    import torch
    import torch.nn.functional as F

    half = q.shape[2] // 2
    out, lse = attn(q, ks[0], vs[0], True)
    out, lse = out.float(), lse.float().unsqueeze(-1)
    for i in range(1, len(ks)):
        if i <= rank:  # all my queries against the first half of the arriving chunks
            bo, bl = attn(q, ks[i][:, :, :half], vs[i][:, :, :half], False)
            bo, bl = bo.float(), bl.float().unsqueeze(-1)
            out = out - torch.sigmoid(bl - lse) * (out - bo)
            lse = lse - F.logsigmoid(lse - bl)
        else:  # the second half of my queries against all of them
            bo, bl = attn(q[:, :, half:], ks[i], vs[i], False)
            bo, bl = bo.float(), bl.float().unsqueeze(-1)
            o2, l2 = out[:, :, half:], lse[:, :, half:]
            o2 = o2 - torch.sigmoid(bl - l2) * (o2 - bo)
            l2 = l2 - F.logsigmoid(l2 - bl)
            out = torch.cat([out[:, :, :half], o2], dim=2)
            lse = torch.cat([lse[:, :, :half], l2], dim=2)
    return out.to(q.dtype)


def gathered(ks, vs):
    """K/V as the all-gather rotater receives them: one fresh buffer holding every rank's K and V
    (written by the collective; here by copies, which autograd follows back to ``ks``, ``vs``),
    the ring's blocks views into it."""
    import torch

    buf = torch.empty((len(ks), 2, *ks[0].shape), device=ks[0].device, dtype=ks[0].dtype)
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        buf[i, 0].copy_(k)
        buf[i, 1].copy_(v)
    return [buf[i, 0] for i in range(len(ks))], [buf[i, 1] for i in range(len(vs))]


def flash_attn(q, k, v, causal: bool):
    import torch

    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    return res[0], res[1]


def math_attn(q, k, v, causal: bool):
    """CPU stand-in with the same (output, log-sum-exp) contract, for a smoke run."""
    import torch

    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v, lse


def measure(
    tokens_per_rank: int,
    cp: int,
    device: str = "cuda",
    rank: int | None = None,
    gather: bool = False,
    slack: float | None = None,
) -> dict:
    """Median ms of the rank's forward and forward + backward; with ``slack`` (CUDA only) also
    under a ballast that leaves the step only (1 + slack) x its own peak, and the allocator's
    counts during the pressured runs."""
    import torch

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    attn = flash_attn if dev.type == "cuda" else math_attn

    def t(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    shape = (1, HEADS, tokens_per_rank, HEAD_DIM)
    q = t(*shape)
    ks, vs = [t(*shape) for _ in range(cp)], [t(*shape) for _ in range(cp)]
    grad = torch.randn(shape, device=dev, dtype=dtype)
    rank = cp // 2 if rank is None else rank

    def timed(fn) -> float:
        return median_ms(fn, dev, 3, 1)

    def blocks():
        return gathered(ks, vs) if gather else (ks, vs)

    def fwd():
        with torch.no_grad():
            ring_rank(q, *blocks(), rank, attn)

    def fwd_bwd():
        ring_rank(q, *blocks(), rank, attn).backward(grad)

    out = {"fwd_ms": timed(fwd), "fwd_bwd_ms": timed(fwd_bwd)}
    if slack is None or dev.type != "cuda":
        return out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.empty_cache()  # start from what the step itself needs, nothing cached
    free, _ = torch.cuda.mem_get_info()
    keep = int(step_peak * (1 + slack))
    ballast = torch.empty(max(0, free - keep), dtype=torch.uint8, device=dev)
    before = torch.cuda.memory_stats()
    pressured = timed(fwd_bwd)
    after = torch.cuda.memory_stats()
    del ballast

    def delta(key: str) -> int:
        return int(after.get(key, 0) - before.get(key, 0))

    out.update(
        step_peak_gib=step_peak / 2**30,
        pressured_fwd_bwd_ms=pressured,
        pressure_ratio=pressured / out["fwd_bwd_ms"],
        alloc_retries=delta("num_alloc_retries"),
        cuda_mallocs=delta("num_device_alloc"),
        cuda_frees=delta("num_device_free"),
        # synchronize-all-streams calls: what a retry or a freed cached block costs the device
        stream_syncs=delta("num_sync_all_streams"),
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-rank", type=int, default=32768)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--gpu", default=None, help="catalog part for the prediction (default: auto)")
    ap.add_argument(
        "--ranks",
        choices=["middle", "extremes"],
        default="middle",
        help="time rank cp/2 only, or ranks 0, cp/2 and cp-1 (the slowest sets the pace)",
    )
    ap.add_argument(
        "--gather", action="store_true", help="K/V from one fresh all-gather buffer per call"
    )
    ap.add_argument(
        "--slack",
        type=float,
        default=None,
        help="also time under a ballast leaving (1 + slack) x the step's peak (CUDA)",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="output path without suffix (default: in --results)"
    )
    add_results_arg(ap)
    args = ap.parse_args()
    try:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        name = None
    gpu = args.gpu or ("h200" if name and "H200" in name else "h100-sxm")
    # The caching allocator's mode (torchtitan's launcher of December 2024, run_llama_train.sh,
    # sets expandable_segments:True); read by CUDA initialisation, so it is set by the caller.
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    rows = []
    for cp in args.cp:
        row = {"cp": cp, "predicted": predicted_ms(args.tokens_per_rank, cp, gpu)}
        row["measured"] = (
            measure(args.tokens_per_rank, cp, gather=args.gather, slack=args.slack)
            if name
            else None
        )
        if name and args.ranks == "extremes":
            row["per_rank"] = {
                r: measure(args.tokens_per_rank, cp, rank=r) for r in sorted({0, cp // 2, cp - 1})
            }
            row["slowest"] = max(row["per_rank"].values(), key=lambda m: m["fwd_bwd_ms"])
        rows.append(row)
    lines = [
        f"# Ring attention, one rank of {args.tokens_per_rank} tokens, Llama 3 8B heads: "
        f"measured on {name or '(no GPU)'} (no communication) vs model ({gpu}, flash2)",
        "",
        "| cp | measured fwd ms | predicted fwd ms | measured fwd+bwd ms | predicted fwd+bwd ms "
        "| predicted / measured (fwd+bwd) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        mf = f"{m['fwd_ms']:.1f}" if m else "n/a"
        mb = f"{m['fwd_bwd_ms']:.1f}" if m else "n/a"
        ratio = f"{p['fwd_bwd_ms'] / m['fwd_bwd_ms']:.3f}" if m else "n/a"
        lines.append(
            f"| {r['cp']} | {mf} | {p['fwd_ms']:.1f} | {mb} | {p['fwd_bwd_ms']:.1f} | {ratio} |"
        )
    pressured = [r for r in rows if r["measured"] and "pressure_ratio" in r["measured"]]
    if pressured:
        lines += [
            "",
            f"Under allocator pressure (ballast leaving {1 + args.slack:.2f} x the step's peak"
            f"{', K/V from a fresh gather buffer per call' if args.gather else ''}; "
            f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf or '(unset)'}):",
            "",
            "| cp | step peak GiB | fwd+bwd ms | pressured ms | ratio | alloc retries "
            "| cudaMalloc | cudaFree | stream syncs |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in pressured:
            m = r["measured"]
            lines.append(
                f"| {r['cp']} | {m['step_peak_gib']:.2f} | {m['fwd_bwd_ms']:.1f} "
                f"| {m['pressured_fwd_bwd_ms']:.1f} | {m['pressure_ratio']:.3f} "
                f"| {m['alloc_retries']} | {m['cuda_mallocs']} | {m['cuda_frees']} "
                f"| {m['stream_syncs']} |"
            )
    per_rank = [r for r in rows if r.get("per_rank")]
    if per_rank:
        lines += [
            "",
            "| cp | rank | measured fwd ms | measured fwd+bwd ms |",
            "|---:|---:|---:|---:|",
        ]
        for r in per_rank:
            for rank, m in r["per_rank"].items():
                lines.append(f"| {r['cp']} | {rank} | {m['fwd_ms']:.1f} | {m['fwd_bwd_ms']:.1f} |")
        lines += [
            "",
            "Slowest rank vs the model (fwd+bwd): "
            + ", ".join(
                f"cp {r['cp']}: {r['predicted']['fwd_bwd_ms'] / r['slowest']['fwd_bwd_ms']:.3f}"
                for r in per_rank
            ),
        ]
    text = "\n".join(lines)
    print(text)
    suffix = ("_gather" if args.gather else "") + ("_pressure" if args.slack is not None else "")
    out = args.out or args.results / f"ring_attention_rank_{gpu}{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "tokens_per_rank": args.tokens_per_rank,
                "gpu": name,
                "alloc_conf": alloc_conf,
                "rows": rows,
            },
            indent=1,
        )
    )
    out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
