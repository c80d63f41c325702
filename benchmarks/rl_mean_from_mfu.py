"""How well a verl row's mean response can be recovered from its published MFU (the route
rl_runs_other.csv takes, whose tables publish no mean), checked on the rows of the same tables
that do publish it: ISEEKYAN/verl_megatron_practice dapo14b.csv and dapo32b.csv at 9a8f18f
(DAPO-math, 512 prompts x 16 samples, H20, verl's MFU against 148 TF/s).

Two routes to the tokens a step trained (prompt + response, every sample):
- throughput: verl's `perf/throughput` is the step's tokens / (step seconds x GPUs), so
  tokens = throughput x GPUs x step; less the published mean response, the mean prompt;
- MFU: verl's flops counter (verl/utils/flops_counter.py at 6a9a1b8) counts 6 x the non-attention
  parameters per token plus 12 x seqlen^2 x heads x head_dim x layers per sequence, over the
  update_actor time; inverted with every sequence at the mean length, less a 150-token prompt.

Run: python benchmarks/rl_mean_from_mfu.py [--results DIR] (stdlib only; the figures are the
tables', copied by hand); it prints the table and writes DIR/rl_mean_from_mfu.md.
"""

from __future__ import annotations

import argparse
import math
import sys

from _common import add_results_arg  # benchmarks/, this script's folder

SAMPLES = 512 * 16
H20_PEAK = 148e12


def _counter(hidden, ffn, layers, heads, kv_heads, head_dim, vocab):
    """(per-token flops, per-sequence attention coefficient) of verl's dense-model counter."""
    attn = hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim)
    params = (hidden * ffn * 3 + attn) * layers + vocab * hidden * 2
    return 6 * params, 12 * head_dim * heads * layers


MODELS = {  # the models' config.json
    "qwen2.5-14b": _counter(5120, 13824, 48, 40, 8, 128, 152064),
    "qwen3-14b": _counter(5120, 17408, 40, 40, 8, 128, 151936),
    "qwen2.5-32b": _counter(5120, 27648, 64, 40, 8, 128, 152064),
}

# table, row, backend, model, GPUs, tokens/s/GPU, mean response, step s, update_actor s, MFU
ROWS = [
    ("dapo14b", 2, "fsdp", "qwen2.5-14b", 32, 297.809, 773.79, 799.774, 239.511, 0.63),
    ("dapo14b", 3, "fsdp", "qwen2.5-14b", 32, 287.819, 762.937, 817.488, 244.738, 0.611),
    ("dapo14b", 4, "fsdp", "qwen3-14b", 32, 186.052, 3344.284, 4810.949, 1019.47, 0.63),
    ("dapo14b", 5, "fsdp", "qwen3-14b", 32, 186.723, 3210.381, 4608.703, 1068.28, 0.578),
    ("dapo14b", 6, "fsdp", "qwen3-14b", 32, 186.36, 3656.42, 5230.469, 1226.361, 0.574),
    ("dapo14b", 7, "megatron", "qwen2.5-14b", 32, 279.23, 791.082, 872.585, 265.34, 0.65),
    ("dapo14b", 8, "megatron", "qwen3-14b", 32, 213.561, 3510.21, 4398.413, 933.793, 0.768),
    ("dapo14b", 9, "megatron", "qwen3-14b", 32, 255.982, 3131.232, 3289.907, 770.015, 0.83),
    ("dapo14b", 10, "megatron", "qwen3-14b", 32, 236.793, 3040.52, 3459.649, 799.448, 0.781),
    ("dapo14b", 11, "megatron", "qwen3-14b", 32, 252.462, 3644.968, 3857.987, 905.894, 0.82),
    ("dapo32b", 2, "fsdp", "qwen2.5-32b", 64, 127.835, 1827.308, 2001.112, 576.181, 0.625),
    ("dapo32b", 3, "fsdp", "qwen2.5-32b", 64, 110.137, 2819.061, 3482.747, 917.905, 0.618),
    ("dapo32b", 4, "fsdp", "qwen2.5-32b", 64, 148.315, 1489.726, 1434.384, 473.663, 0.626),
    ("dapo32b", 5, "fsdp", "qwen2.5-32b", 32, 173.166, 1354.366, 2257.136, 819.309, 0.665),
    ("dapo32b", 6, "megatron", "qwen2.5-32b", 32, 174.121, 1544.39, 2527.259, 840.336, 0.753),
    ("dapo32b", 7, "megatron", "qwen2.5-32b", 64, 120.279, 1429.932, 1702.944, 422.157, 0.72),
]


def mean_sequence_from_mfu(model: str, gpus: int, update_s: float, mfu: float) -> float:
    per_token, attn = MODELS[model]
    flops = mfu * H20_PEAK * update_s * gpus / SAMPLES  # one sequence's
    return (-per_token + math.sqrt(per_token**2 + 4 * attn * flops)) / (2 * attn)


def table() -> str:
    lines = [
        "| row | backend | mean response | prompt (throughput) | response (MFU, 150 prompt) "
        "| error |",
        "|---|---|---|---|---|---|",
    ]
    for name, n, backend, model, gpus, thr, resp, step, upd, mfu in ROWS:
        prompt = thr * gpus * step / SAMPLES - resp
        derived = mean_sequence_from_mfu(model, gpus, upd, mfu) - 150
        lines.append(
            f"| {name} r{n} | {backend} | {resp:.0f} | {prompt:.0f} | {derived:.0f} "
            f"| {derived / resp - 1:+.1%} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_results_arg(ap)
    args = ap.parse_args()
    text = table()
    command = " ".join(["python", "benchmarks/rl_mean_from_mfu.py", *sys.argv[1:]])
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "rl_mean_from_mfu.md").write_text(f"Produced by `{command}`.\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
