"""training.moe_stack (issue 37): one of the documented stacks, consistent with moe_dispatcher,
and no whole-iteration CUDA graph for a stack that waits on the host; each refusal one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.runspec.errors import SpecError
from aihpc.runspec.training import MOE_STACKS, TrainingSpec


@pytest.mark.parametrize("stack", MOE_STACKS)
def test_every_documented_stack_is_accepted(stack: str) -> None:
    assert TrainingSpec(moe_stack=stack).moe_stack == stack


def test_an_unknown_stack_is_refused_naming_the_choices() -> None:
    with pytest.raises(SpecError) as err:
        TrainingSpec(moe_stack="megatron")
    assert err.value.field == "training.moe_stack" and "megatron-deepep" in str(err.value)


def test_a_dispatcher_the_stack_does_not_run_is_refused() -> None:
    with pytest.raises(SpecError) as err:
        TrainingSpec(moe_stack="megatron-alltoall", moe_dispatcher="hierarchical")
    assert err.value.field == "training.moe_dispatcher" and "alltoall" in str(err.value)
    assert TrainingSpec(moe_stack="megatron-deepep", moe_dispatcher="hierarchical")


@pytest.mark.parametrize("stack", ["megatron-deepep", "torch-native", "torch-deepep"])
def test_full_cuda_graphs_need_a_sync_free_dispatcher(stack: str) -> None:
    with pytest.raises(SpecError) as err:
        TrainingSpec(moe_stack=stack, cuda_graphs="full")
    assert err.value.field == "training.cuda_graphs" and "megatron-hybridep" in str(err.value)
    assert TrainingSpec(moe_stack="megatron-hybridep", cuda_graphs="full")
    assert TrainingSpec(moe_stack=stack, cuda_graphs="partial")


def test_the_cli_refuses_a_bad_stack_in_one_line(tmp_path: Path) -> None:
    f = tmp_path / "moe.toml"
    f.write_text(
        '[model]\npreset = "qwen3-30b-a3b"\n\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 16\n\n'
        '[parallel]\nglobal_batch_size = 256\nep = 16\n\n[training]\nmoe_stack = "deepep"\n'
    )
    r = CliRunner().invoke(app, ["estimate", str(f)])
    assert r.exit_code == 2, r.output
    assert "training.moe_stack" in r.stderr and "megatron-hybridep" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
