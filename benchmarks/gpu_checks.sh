#!/usr/bin/env bash
# The measurements the performance model still waits for that one GPU can make, as one script
# for a session that is lent a GPU. On an H200 (2026-12-04) steps 1-4 and 7-9 took 3.5 minutes
# (step 10, added later, has not run on a GPU yet: it compiles four runs, budget 5 minutes)
# together; step 5 trains six plans and needs 5 minutes or more. Run from the repository
# root, with the package installed or not (a checkout's src/ is put on PYTHONPATH if aihpc does
# not import):
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]      # default: ./benchmark-results
#   GPU_CHECKS_STEPS="8 9 3" GPU_CHECKS_BUDGET_S=300 bash benchmarks/gpu_checks.sh OUT
#
# Steps run in GPU_CHECKS_STEPS's order (default: the MoE steps first), each under its own time
# cap and none started past GPU_CHECKS_BUDGET_S seconds (default 3600); a step that fails or
# times out is reported and the next one runs. Output goes to OUT_DIR/gpu_checks.log too; the
# exit status is 1 if any step failed or was skipped. Without a CUDA GPU the script says so in one
# line and exits 0 having run nothing (tests/benchmarks/test_gpu_checks_skip.py).
#
# 1. One ring-attention rank at both ends of the ring (ranks 0 and cp - 1 run blocks of one shape
#    each; the exchanges keep ranks in step, so the slower end sets the pace) for CP 2, 4, 8:
#    is the torchtitan CP 4 / CP 8 miss (I08, I09) in one rank's kernels?
# 2. The same rank with K/V from one fresh all-gather buffer per call and the caching allocator
#    held to 5% above the step's peak: is it the allocator near its limit? Twice: with the
#    allocator's defaults, and with expandable segments, which torchtitan's launcher of the
#    measured runs set (run_llama_train.sh at 9dec370: PYTORCH_CUDA_ALLOC_CONF=
#    "expandable_segments:True").
# 3. MoE dispatch / combine (aihpc.comm, `aihpc bench moe`) on every GPU of the machine in
#    DeepEP's setting (tokens per rank 1024 / 4096 / 16384, hidden 7168, top-8 of 256 experts,
#    bf16), our operator against a plain all_to_all_single dispatcher. With one GPU there is no
#    network: the times are our operator's own permutation, grouping and float32 reduce kernels
#    (what the model prices as permute / unpermute); with 8 GPUs the same line is DeepEP's
#    intranode row (DeepEP docs/legacy.md: 153 / 158 GB/s dispatch / combine on H800 NVLink).
# 4. The GPU tests of the operators and the MoE block: the NCCL path bitwise the CPU path and
#    deterministic, torch's grouped_mm against the per-expert loop in bf16.
# 5. The trainer's measured step time against the model's prediction for one-GPU plans of a
#    1.2 B-parameter model (micro-batch 1/2/4, recompute none/selective/full) on the catalog GPU
#    the machine has: median |error| and Spearman's rho (issue 16's targets: <= 20%, >= 0.8).
# 6. With two GPUs or more: what one NCCL channel moves point-to-point over NVLink
#    (NCCL_MAX_CTAS=1, the send/recv ring of Transformer Engine's CP step), the catalog's
#    p2p_channel_bw_GBps. Blackwell's figure is DeepEP's per-SM push, not an NCCL measurement;
#    Hopper's is an NCCL one (gpus.toml). Its busbw replaces the figure for the part measured.
# 7. A linear's three GEMMs (forward over K, input gradient over N, weight gradient over the
#    tokens) in BF16 and FP8 for shapes whose contraction lengths differ most: the model prices
#    each at its own K on the curve fitted to forward GEMMs (gpus.toml gemm_half_k), so the
#    weight gradients of a Hopper part come out 1-7% faster than the forward; is that so?
# 8. The routed experts' GEMMs of the small-expert MoE rows (H08, H09, H12, H13: 8-16 local
#    experts, one launch each, eager; priced 37-54% fast): the per-expert loop forward and
#    backward in the row's precision, one grouped GEMM beside it, and the host's issue time per
#    expert GEMM, each next to the model's figure (moe_expert_gemms.py). Are the experts' GEMMs or the
#    eager host the miss?
# 9. The whole routed part of one of those rows' MoE layers as an eager PyTorch program (the
#    trainer's own block: router over all experts, our permute with its host-read counts, the
#    local experts per launch and grouped, the weighted unpermute; forward and backward; BF16):
#    wall time, GPU kernel time and the GPU's idle time beside the model's GPU time for the same
#    work (moe_layer_eager.py). Does eager plumbing at these shapes cost what the model prices?
# 10. The trainer's one-GPU step with training.compile off and on (tiny-llama-small, micro-batch 1
#    and 4: host-bound), each against its predicted step time, and the host's issue of one eager
#    and one compiled decoder layer against perf/step/host_issue.py's price (compile_step.py).
#    Is an eager layer's host issue what the model charges, and does compile remove it?
# 11. The routed experts' GEMMs of the held-out MoE rows (issue 37; moe_heldout_runs.csv): T01,
#    torchtitan's Qwen3-30B-A3B on 8 B200 (16 local experts of 768, one grouped GEMM per
#    projection, 16,384 rows each; priced 42% fast) and Q05, Megatron-Core's Qwen3-235B at TP 4
#    EP 8 on H100 (priced 64% fast). On a GPU of another kind the "model here" column is the
#    comparison. Are the experts' GEMMs the miss of these rows too?
# 12. Incremental decoding on the GPU: the trainer's Llama (1.2 B parameters, bf16, eager) with
#    its KV cache, prefill and decode-step times across batch 1 / 8 / 32, prompt 512 / 2048 and
#    output 64 / 256, beside the inference estimate for the catalog GPU
#    (inference_vs_measured.py --gpu): is eager decoding launch-bound as the model prices it
#    (kernel launches, KERNELS_PER_LAYER of perf/infer/kernels.py) or does it read the weights
#    at HBM bandwidth? About 2 minutes on an H100.
# Each writes <name>.json and <name>.md (6: a JSON only); docs/performance-model.md (I08, I09, the
# CP exchange) and docs/moe.md say what each outcome would mean.
set -uo pipefail
out=${1:-benchmark-results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee -a "$out/gpu_checks.log") 2>&1
py=${PYTHON:-$(command -v python3 || command -v python)}
repo=$(cd "$(dirname "$0")/.." && pwd)
if ! "$py" -c 'import aihpc' 2>/dev/null; then
    export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
steps=${GPU_CHECKS_STEPS:-8 11 9 3 4 10 7 1 2 5 6 12}
for n in $steps; do
    if ! [[ $n =~ ^([1-9]|1[0-2])$ ]]; then
        echo "gpu_checks.sh: GPU_CHECKS_STEPS: no step '$n' (steps are 1 to 12)" >&2
        exit 2
    fi
done
"$py" - <<'PY'
import sys

try:
    import torch

    import aihpc
except ImportError as err:
    sys.exit(f"gpu_checks.sh: {err} (set PYTHON to an interpreter with torch and aihpc)")

if not torch.cuda.is_available():
    sys.exit(3)
print(torch.cuda.get_device_name(), "torch", torch.__version__, "CUDA", torch.version.cuda)
print("grouped_mm:", hasattr(torch.nn.functional, "grouped_mm"), "aihpc:", aihpc.__file__)
PY
rc=$?
if ((rc == 3)); then
    echo "gpu_checks.sh: skipped, no CUDA GPU visible (every step measures one); nothing run"
    exit 0
fi
((rc == 0)) || exit 2
cd "$repo/benchmarks"
budget=${GPU_CHECKS_BUDGET_S:-3600}
ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())')
failed=()

# run_step NAME CAP_S COMMAND...: COMMAND under min(CAP_S, the budget left), its status noted
run_step() {
    local name=$1 cap=$2 left rc t0=$SECONDS
    shift 2
    left=$((budget - SECONDS))
    if ((left < 15)); then
        echo "== step $name: skipped, the budget of ${budget}s is spent"
        failed+=("$name:skipped")
        return
    fi
    ((cap > left)) && cap=$left
    echo "== step $name (at most ${cap}s): $*"
    timeout --signal=INT --kill-after=15 "$cap" "$@"
    rc=$?
    echo "== step $name: exit $rc after $((SECONDS - t0))s"
    ((rc == 0)) || failed+=("$name:exit$rc")
}

step1() {
    run_step 1 240 "$py" ring_attention_rank.py --cp 2 4 8 --ranks extremes \
        --out "$out/ring_attention_ranks_extremes"
}
step2() {
    run_step 2 240 "$py" ring_attention_rank.py --cp 2 4 8 --gather --slack 0.05 \
        --out "$out/ring_attention_rank_gather_pressure"
    run_step 2x 240 env PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True" \
        "$py" ring_attention_rank.py --cp 2 4 8 --gather --slack 0.05 \
        --out "$out/ring_attention_rank_gather_pressure_expandable"
}
step3() {
    run_step 3 180 "$py" moe_dispatch.py --nproc "$ngpu" --tokens 1024,4096,16384 --hidden 7168 \
        --experts 256 --iters 10 --reps 3 --tag "gpu_${ngpu}x" --results "$out"
}
step4() {
    run_step 4 240 "$py" -m pytest -q -p no:cacheprovider -m gpu \
        ../tests/comm/test_moe_dispatch_gpu.py ../tests/runtime/test_moe.py \
        --junitxml "$out/moe_gpu_tests.xml"
}
step5() { run_step 5 420 "$py" predicted_vs_measured.py --gpu --steps 20 --results "$out"; }
step6() {
    if ((ngpu >= 2)); then
        run_step 6 180 env NCCL_MAX_CTAS=1 "$py" -m aihpc bench comm -C send_recv \
            --nproc-per-node "$ngpu" -b 64M -e 1G -d bfloat16 --json \
            --output "$out/p2p_one_channel.json"
    else
        echo "== step 6: skipped, one GPU (it measures NVLink between two)"
    fi
}
step7() { run_step 7 300 "$py" kernel_efficiency.py --backward --out "$out/kernel_efficiency"; }
step8() { run_step 8 150 "$py" moe_expert_gemms.py --results "$out"; }
step9() { run_step 9 180 "$py" moe_layer_eager.py --results "$out"; }
step10() { run_step 10 300 "$py" compile_step.py --steps 20 --results "$out"; }
step11() {
    run_step 11 150 "$py" moe_expert_gemms.py --csv moe_heldout_runs.csv --rows T01 Q05 \
        --name moe_expert_gemms_heldout --results "$out"
}
step12() {
    run_step 12 300 "$py" inference_vs_measured.py --gpu --batches 1 8 32 --prompts 512 2048 \
        --outputs 64 256 --results "$out"
}

for n in $steps; do "step$n"; done
if ((${#failed[@]})); then
    echo "gpu_checks.sh: not done: ${failed[*]} (log: $out/gpu_checks.log)"
    exit 1
fi
echo "gpu_checks.sh: all steps done in ${SECONDS}s; results in $out"
