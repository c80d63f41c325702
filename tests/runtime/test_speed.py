"""The trainer's speed features (runtime/speed.py): FSDP2's mixed-precision policy, torch.compile
of each block, and the refusals of what a host cannot run. Real processes, no mocks.

Tolerances. bf16 parameters (8-bit significand) round each weight by up to 2^-9 relative; the
loss, a mean over many tokens, moved far less: 5.3e-5 relative after 4 AdamW steps at lr 3e-3
(measured, 2 gloo ranks against one fp32 process). We allow 1e-3, four times below bf16's own
rounding of one value (3.9e-3), so a run whose weights were gathered in fp32 would pass and one
whose losses drifted by a bf16 step would not. Compiled blocks reorder and fuse fp32 arithmetic:
losses moved by 9.6e-8 relative over 6 steps (measured); we allow 2e-6, as test_nd_parity.py
allows for another summation order.
"""

from __future__ import annotations

import signal

import pytest
from speed_workers import spawn
from train_cli import events, losses, ok
from train_cli import train as run_train

pytestmark = pytest.mark.slow

BF16_LOSS_RTOL = 1e-3
COMPILE_LOSS_RTOL = 2e-6

SPEC = """
[model]
preset = "tiny-llama"
seq_length = 32
[cluster]
gpu = "h100-sxm"
num_gpus = 1
[parallel]
micro_batch_size = 2
global_batch_size = 4
[training]
train_steps = 6
learning_rate = 3e-3
warmup_steps = 2
compile = {compile}
precision = "{precision}"
[checkpoint]
interval_steps = 3
async_save = false
"""


def write_spec(path, compile=True, precision="bf16"):
    path.write_text(SPEC.format(compile=str(compile).lower(), precision=precision))
    return path


def train(spec, run_dir, *extra, env=None):
    return run_train(
        spec, run_dir, *extra, timeout=400, env={"OMP_NUM_THREADS": "1", **(env or {})}
    )


def test_fsdp_gathers_bf16_and_reduces_fp32(tmp_path):
    """param_dtype = "bf16": every FSDP2 unit all-gathers bf16 (the gather's inputs, cast before
    the collective), the linears compute in bf16, the gradients are reduced in fp32
    (grad_reduce_dtype), and the losses follow one fp32 process within bf16 rounding."""
    ref = spawn(1, "train_losses", tmp_path / "ref", steps=4, param_dtype="fp32")[0]
    fp32 = spawn(2, "train_losses", tmp_path / "fp32", steps=4, param_dtype="fp32")
    bf16 = spawn(2, "train_losses", tmp_path / "bf16", steps=4, param_dtype="bf16")
    assert fp32[0]["gathered"] == ["torch.float32"]  # the default on a CPU (auto) gathers fp32
    for rank in bf16:
        assert rank["gathered"] == ["torch.bfloat16"]
        assert rank["compute"] == ["torch.bfloat16"]
        assert rank["grads"] == ["torch.float32"]
    for a, b in zip(ref["losses"], bf16[0]["losses"], strict=True):
        assert b == pytest.approx(a, rel=BF16_LOSS_RTOL)
    assert ref["compute"] == ["torch.float32"]


def test_compiled_blocks_match_eager_and_resume_exactly(tmp_path):
    """training.compile: every block compiled (the run's speed_features event), losses within
    float reordering of the eager run's, and a run killed after its step-3 checkpoint resumes
    to the same losses, bit for bit, as the compiled run that was not interrupted."""
    eager = tmp_path / "eager"
    ok(train(write_spec(tmp_path / "eager.toml", compile=False), eager))
    spec, whole = write_spec(tmp_path / "run.toml"), tmp_path / "whole"
    summary = ok(train(spec, whole))
    feats = events(whole, "speed_features")[0]
    assert feats["compiled_blocks"] == 2  # tiny-llama's two layers
    assert events(eager, "speed_features")[0]["compiled_blocks"] == 0
    for (_, a), (_, b) in zip(losses(eager), losses(whole), strict=True):
        assert float.fromhex(b) == pytest.approx(float.fromhex(a), rel=COMPILE_LOSS_RTOL)
    killed = tmp_path / "killed"
    proc = train(spec, killed, "--inject", "kill:step=5")
    assert proc.returncode == -signal.SIGKILL
    resumed = ok(train(spec, killed))
    assert resumed["resumed_from_step"] == 3
    assert losses(killed) == losses(whole)
    assert resumed["state_sha256"] == summary["state_sha256"]


def _refusal(proc):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_fp8_on_a_cpu_is_refused_in_one_line(tmp_path):
    spec = write_spec(tmp_path / "run.toml", compile=False, precision="fp8")
    line = _refusal(train(spec, tmp_path / "run", env={"CUDA_VISIBLE_DEVICES": ""}))
    assert "training.precision" in line and "fp8" in line and "CUDA" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_compile_without_a_c_compiler_is_refused_in_one_line(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {"PATH": str(empty), "CC": ""}
    line = _refusal(train(write_spec(tmp_path / "run.toml"), tmp_path / "run", env=env))
    assert "training.compile" in line and "C compiler" in line


def test_fp8_converts_the_decoder_linears_and_keeps_their_names():
    """Where torchao is installed (the fp8 extra): every decoder linear becomes a Float8Linear,
    the output layer stays 16-bit, and the parameter names (what checkpoints key on) do not
    change. Conversion only: FP8 GEMMs need a GPU (runs on a CPU are refused above)."""
    pytest.importorskip("torchao.float8")
    import torch
    from speed_workers import CFG

    from aihpc.runspec import TrainingSpec
    from aihpc.runtime.model import Llama
    from aihpc.runtime.speed import apply_fp8, describe

    with torch.device("meta"):
        plain, model = Llama(CFG), Llama(CFG)
    converted = apply_fp8(model)
    assert converted == 7 * CFG.num_layers  # wq wk wv wo w1 w3 w2
    assert type(model.output).__name__ == "Linear"
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert describe(model, TrainingSpec(precision="fp8"), "cuda")["fp8_linears"] == converted


def test_compile_under_tensor_parallel_is_refused_naming_the_degree():
    """torch 2.13 fails in DTensor's redistribute backward behind compiled blocks (found on 2
    gloo ranks, docs/runtime.md): refused before any process starts, not left to crash, by
    the rule set aihpc search marks its plans with."""
    from aihpc.runspec import TrainingSpec
    from aihpc.runspec.parallel import ParallelPlan
    from aihpc.runspec.rules import trainer_compile_refusal

    err = trainer_compile_refusal(ParallelPlan(tp=2, dp=2), TrainingSpec(compile=True))
    assert err is not None
    assert "training.compile" in str(err) and "tp = 2" in str(err)
    # one-way tensor parallel: allowed
    assert trainer_compile_refusal(ParallelPlan(tp=1, dp=4), TrainingSpec(compile=True)) is None
