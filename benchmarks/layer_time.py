"""One transformer layer and the loss, timed on a GPU beside what the performance model predicts.

    python benchmarks/layer_time.py [--preset llama3-8b] [--seq 8192] [--batch 2] [--out PATH]

Runs the trainer's own Llama block (aihpc.runtime: fp32 RMSNorm, fp32 RoPE, SDPA with GQA,
SwiGLU) in bf16 on one GPU, eager and under ``torch.compile``, with SDPA forced to its flash
backend (FlashAttention-2) and to its cuDNN backend, and the output layer with
``F.cross_entropy`` on fp32-upcast logits (torchtitan's 2024 loss), forward and forward +
backward. Beside each it prints the model's figure for the same shapes from
``aihpc.perf.step.compute`` (``attention = "flash2"`` / ``"flash"``; ``fused_kernels`` false for
eager, true for compiled; ``cross_entropy = "eager"``) on the catalog part that matches the GPU.
Without a GPU it prints the predictions only; ``--measured FILE`` re-prices a saved GPU run
with today's model. Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from _common import add_results_arg, median_ms

from aihpc.perf.step import compute
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict

BACKENDS = {"flash2": "FLASH_ATTENTION", "flash": "CUDNN_ATTENTION"}  # aihpc name -> SDPA backend


def predictions(preset: str, seq: int, batch: int, gpu: str, attention: str) -> dict:
    spec = runspec_from_dict(
        {
            "model": {"preset": preset, "seq_length": seq},
            "cluster": {"gpu": gpu, "num_gpus": 1, "gpus_per_node": 1},
            "parallel": {"micro_batch_size": batch, "global_batch_size": batch},
            "training": {"precision": "bf16", "attention": attention, "cross_entropy": "eager"},
        }
    )
    plan, out = spec.plan(), {"gpu": gpu}
    for label, fused in (("eager", False), ("compiled", True)):
        training = replace(spec.training, fused_kernels=fused)
        lt = compute.layer_times(spec.model, spec.cluster.gpu, plan, training, DEFAULT_PARAMS)
        out[label] = {
            "fwd_ms": lt.fwd * 1e3,
            "fwd_bwd_ms": (lt.fwd + lt.bwd) * 1e3,
            "gemm_ms": (lt.fwd_gemm + lt.bwd_gemm) * 1e3,
            "attention_ms": (lt.fwd_attn + lt.bwd_attn) * 1e3,
            "elementwise_ms": (lt.fwd_elementwise + lt.bwd_elementwise) * 1e3,
        }
    lf, lb = compute.logits_time_s(
        spec.model, spec.cluster.gpu, plan, spec.training, DEFAULT_PARAMS
    )
    out["loss"] = {"fwd_ms": lf * 1e3, "fwd_bwd_ms": (lf + lb) * 1e3}
    return out


def measure(preset: str, seq: int, batch: int, device: str = "cuda") -> dict:
    import torch
    import torch.nn.functional as F

    from aihpc.runspec.model import model_from_table
    from aihpc.runtime.model import Block, LlamaConfig, RMSNorm, rope_tables

    cfg = LlamaConfig.from_spec(model_from_table({"preset": preset, "seq_length": seq}))
    dev, bf16 = torch.device(device), torch.bfloat16
    torch.manual_seed(0)
    block = Block(cfg).to(dev, bf16)
    cos, sin = (t.to(dev) for t in rope_tables(seq, cfg.head_dim, cfg.rope_theta))
    x = torch.randn(batch, seq, cfg.dim, device=dev, dtype=bf16, requires_grad=True)
    gy = torch.randn_like(x)

    def timed(fn) -> float:
        return median_ms(fn, dev, 5, 2)

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    out = {"gpu": name, "torch": torch.__version__}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for attention, backend in BACKENDS.items():
        kind = getattr(SDPBackend, backend)
        if dev.type != "cuda":  # CPU smoke run: whatever backend runs there
            kind = SDPBackend.MATH
        for label, layer in (("eager", block), ("compiled", torch.compile(block))):

            def fwd(layer=layer, kind=kind):
                with torch.no_grad(), sdpa_kernel([kind]):
                    layer(x, cos, sin)

            def fwd_bwd(layer=layer, kind=kind):
                with sdpa_kernel([kind]):
                    y = layer(x, cos, sin)
                y.backward(gy)

            out[f"{attention} {label}"] = {"fwd_ms": timed(fwd), "fwd_bwd_ms": timed(fwd_bwd)}
    norm = RMSNorm(cfg.dim, cfg.norm_eps).to(dev, bf16)
    head = torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False).to(dev, bf16)
    targets = torch.randint(0, cfg.vocab_size, (batch * seq,), device=dev)

    def loss_fwd():
        with torch.no_grad():
            F.cross_entropy(head(norm(x)).flatten(0, 1).float(), targets)

    def loss_fwd_bwd():
        F.cross_entropy(head(norm(x)).flatten(0, 1).float(), targets).backward()

    out["loss"] = {"fwd_ms": timed(loss_fwd), "fwd_bwd_ms": timed(loss_fwd_bwd)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--gpu", default=None, help="catalog part for the prediction (default: auto)")
    ap.add_argument(
        "--out", type=Path, default=None, help="output path without suffix (default: in --results)"
    )
    add_results_arg(ap)
    ap.add_argument(
        "--measured",
        type=Path,
        default=None,
        help="re-price a saved measurement (<out>.json of a GPU run) with today's model",
    )
    args = ap.parse_args()
    if args.measured:
        saved = json.loads(args.measured.read_text())
        args.preset, args.seq, args.batch = saved["preset"], saved["seq"], saved["batch"]
        measured = saved["measured"]
        args.out = args.out or args.measured.with_suffix("")
    else:
        try:
            import torch

            has_gpu = torch.cuda.is_available()
        except ImportError:
            has_gpu = False
        measured = measure(args.preset, args.seq, args.batch) if has_gpu else None
    gpu = args.gpu or ("h200" if measured and "H200" in measured["gpu"] else "h100-sxm")
    predicted = {}
    for attention in BACKENDS:
        pred = predictions(args.preset, args.seq, args.batch, gpu, attention)
        predicted.update({f"{attention} {k}": pred[k] for k in ("eager", "compiled")})
    predicted["loss"] = pred["loss"]
    doc = {"preset": args.preset, "seq": args.seq, "batch": args.batch}
    doc.update(measured=measured, predicted=predicted)
    lines = [
        f"# One {args.preset} layer, batch {args.batch} x {args.seq} tokens, bf16: "
        f"measured on {measured['gpu'] if measured else '(no GPU)'} vs model ({gpu})",
        "",
        "attention flash2 = SDPA's flash backend (FlashAttention-2), flash = its cuDNN backend.",
        "",
        "| what | measured ms | predicted ms | predicted / measured |",
        "|---|---:|---:|---:|",
    ]
    for part in predicted:
        for key in ("fwd_ms", "fwd_bwd_ms"):
            p = predicted[part][key]
            m = measured[part][key] if measured else None
            ratio = f"{p / m:.3f}" if m else "n/a"
            mtxt = f"{m:.2f}" if m else "n/a"
            lines.append(f"| {part} {key[:-3]} | {mtxt} | {p:.2f} | {ratio} |")
    text = "\n".join(lines)
    print(text)
    out = args.out or args.results / f"layer_time_{args.preset}_{gpu}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
