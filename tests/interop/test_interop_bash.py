"""The launch-script reader (interop/bash.py, a real bash grammar): what bash would pass to the
program, the branch the script's variables select, assumptions named one line each, and
nothing ever run (issue 36 item 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.interop import import_megatron
from aihpc.interop.bash import read_script
from aihpc.interop.shell import command_tokens
from aihpc.runspec import SpecError

runner = CliRunner()
_MODEL = (
    "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 1 --lr 1e-4"
)


def _launch(body: str, tail: str = "") -> str:
    return f"#!/bin/bash\n{body}\ntorchrun --nproc_per_node 8 pretrain_gpt.py {_MODEL} {tail}\n"


def test_a_file_guard_is_not_the_launch_line() -> None:
    """`if [ ! -f "$PRETRAIN_SCRIPT_PATH" ]` names the script: the launch is the torchrun line."""
    text = (
        'P="pretrain_gpt.py"\nif [ ! -f "$P" ]; then\n  echo "missing $P"; exit 1\nfi\n'
        f"torchrun --nproc_per_node 8 $P {_MODEL} --bf16 --tensor-model-parallel-size 2\n"
    )
    launcher, words = command_tokens(text, "pretrain_gpt.py")
    assert launcher[0] == "torchrun"
    assert words[words.index("--tensor-model-parallel-size") + 1] == "2"
    imported = import_megatron(text)
    assert imported.spec().plan().tp == 2
    assert any("exists where the script runs" in n for n in imported.notes)


def test_array_appends_and_quoted_words_split_as_the_launch_expands_them() -> None:
    """`ARR+=(...)` appends; a quoted "--flag value" element is two words when the array is
    expanded unquoted, and one word (which Megatron's argparse refuses) when quoted."""
    body = 'A=(--bf16)\nA+=("--fp8-format hybrid" --use-distributed-optimizer)'
    imported = import_megatron(_launch(body, "${A[@]}"))
    spec = imported.spec()
    assert spec.training.precision == "fp8"
    assert spec.plan().zero_stage == 1
    with pytest.raises(SpecError, match="unrecognized arguments"):
        import_megatron(_launch(body, '"${A[@]}"'))


def test_branch_is_taken_from_the_scripts_variables_or_named() -> None:
    """FP8=1 set in the script decides `[ "$FP8" = "1" ]` silently; FP8 from the environment
    takes the plain run's branch (unset: the else) and says so on one line."""
    cond = 'if [ "$FP8" = "1" ]; then P=(--bf16 --fp8-format hybrid); else P=(--bf16); fi'
    set_here = import_megatron(_launch(f"FP8=1\n{cond}", "${P[@]}"))
    assert set_here.spec().training.precision == "fp8"
    assert not [n for n in set_here.notes if "assumed" in n]
    from_env = import_megatron(_launch(cond, "${P[@]}"))
    assert from_env.spec().training.precision == "bf16"
    assumed = [n for n in from_env.notes if "assumed" in n]
    assert len(assumed) == 1 and "$FP8 unset" in assumed[0]


def test_case_default_and_assign_default_expansions() -> None:
    body = (
        ": ${TP:=4}\nMODE=${MODE:-sp}\n"
        'case "$MODE" in\n  sp|seq) X=(--sequence-parallel) ;;\n  *) X=() ;;\nesac'
    )
    spec = import_megatron(_launch(body, "--bf16 --tensor-model-parallel-size $TP ${X[@]}")).spec()
    assert (spec.plan().tp, spec.plan().sequence_parallel) == (4, True)


def test_nothing_in_the_script_is_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = (
        f"touch {marker}\nX=$(touch {marker})\nY=`touch {marker}`\neval touch {marker}\n"
        f"L=$(get_layers)\nsource {marker}.sh\n"
    )
    script = read_script(text)
    assert not marker.exists()
    assert script.scalars["L"] == "$(get_layers)"
    assert any("$(get_layers) is not run" in n for n in script.notes)
    assert any("is not followed" in n for n in script.notes)
    with pytest.raises(SpecError, match="--num-layers"):
        import_megatron(_launch("L=$(get_layers)", "--bf16 --num-layers $L"))


def test_bash_c_string_and_for_loop_are_followed() -> None:
    text = (
        "A=()\nfor f in --bf16 --use-distributed-optimizer; do A+=($f); done\n"
        f'srun --nodes 2 bash -c "torchrun --nnodes 2 --nproc-per-node 8 pretrain_gpt.py '
        f'{_MODEL} ${{A[*]}}"\n'
    )
    imported = import_megatron(text)
    spec = imported.spec()
    assert (spec.cluster.num_gpus, spec.plan().zero_stage) == (16, 1)


def test_a_growing_array_is_one_line_not_memory() -> None:
    text = "A=(x)\n" + 'A+=("${A[@]}")\n' * 40 + "torchrun pretrain_gpt.py ${A[@]}\n"
    with pytest.raises(SpecError, match="a value of at most"):
        read_script(text)


def test_cli_refuses_a_bert_script_in_one_line(tmp_path: Path) -> None:
    src = tmp_path / "bert.sh"
    src.write_text(f"torchrun --nproc_per_node 8 pretrain_bert.py {_MODEL} --bf16\n")
    result = runner.invoke(app, ["import", "megatron", str(src), "-o", str(tmp_path / "o.toml")])
    assert result.exit_code == 2
    assert "not a decoder-only GPT" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o.toml").exists()


@pytest.mark.parametrize(
    "text",
    [
        "X=" + "$(" * 20000,
        "if true; then " * 5000 + "fi; " * 5000,
        'A="' + "${X:-" * 3000 + "}" * 3000 + '"',
        _launch("", "--bf16 --recompute-granularity full uniform"),
        _launch("", "--bf16 --use-megatron-fsdp --data-parallel-sharding-strategy optim grads"),
        _launch("", "--bf16 --cp-comm-type p2p a2a"),
    ],
    ids=["subst-20000", "if-5000", "default-3000", "granularity", "fsdp", "cp"],
)
def test_hostile_scripts_are_one_line(text: str) -> None:
    """Found by mutating the corpus (12,000 seeded cases, 0 tracebacks after): a flag given two
    values where one is read was a TypeError; deep nesting is one line, not a RecursionError."""
    with pytest.raises(SpecError):
        import_megatron(text, num_gpus=8)


def test_a_function_that_calls_itself_is_followed_a_bounded_depth() -> None:
    spec = import_megatron("f() { f; }; f\n" + _launch("", "--bf16"), num_gpus=8).spec()
    assert spec.cluster.num_gpus == 8


def test_sbatch_lines_set_the_slurm_variables_the_script_reads() -> None:
    """`#SBATCH -N 3` (before the first command, where sbatch reads it) makes Slurm set
    SLURM_NNODES for the script: the launch reads 3 nodes and says where it came from."""
    head = "#!/bin/bash\n#SBATCH -N 3\n#SBATCH --ntasks-per-node 1 --gpus-per-node=h100:4\n"
    body = (
        "torchrun --nproc_per_node $SLURM_GPUS_PER_NODE --nnodes $SLURM_NNODES "
        f"--rdzv_endpoint h:1 pretrain_gpt.py {_MODEL} --bf16\n"
    )
    imported = import_megatron(head + "\n# a comment\n" + body)
    assert imported.spec().cluster.num_gpus == 12
    assert "SLURM_NNODES = 3 from #SBATCH -N 3" in imported.notes
    assert "SLURM_GPUS_PER_NODE = 4 from #SBATCH --gpus-per-node=h100:4" in imported.notes
    # a line after the first command is not an sbatch option: the variable stays unset
    late = "#!/bin/bash\necho start\n#SBATCH --nodes=3\n" + body
    with pytest.raises(SpecError, match="SLURM_NNODES"):
        import_megatron(late.replace("$SLURM_GPUS_PER_NODE", "4"))


def test_a_flag_whose_value_expands_to_nothing_names_the_variable() -> None:
    """`--nnodes $N` with N unset is a bare --nnodes: one line naming $N, not 'True'."""
    text = f"#!/bin/bash\ntorchrun --nproc_per_node 8 --nnodes $N pretrain_gpt.py {_MODEL} --bf16\n"
    with pytest.raises(SpecError) as err:
        import_megatron(text)
    line = str(err.value)
    assert line.startswith("--nnodes = '$N'") and "True" not in line and "\n" not in line
    tail = "--bf16 --tensor-model-parallel-size ${TP}"
    with pytest.raises(SpecError, match=r"^--tensor-model-parallel-size = '\$\{TP\}'"):
        import_megatron(_launch("", tail))
    # a switch followed by an empty expansion is still the switch
    assert import_megatron(_launch("", "--bf16 $EXTRA")).spec().training.precision == "bf16"


def test_a_world_that_tp_pp_cp_do_not_divide_is_refused_with_megatrons_reason() -> None:
    """8 GPUs cannot hold tp 4 x pp 4: Megatron-LM's model-parallel groups refuse it; the
    import names the GPUs and the degrees (it said `parallel.dp = 0`, naming neither)."""
    text = _launch("", "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4")
    with pytest.raises(SpecError, match=r"world size 8 is not divisible by .* 4 x 4 x 1 = 16"):
        import_megatron(text)
