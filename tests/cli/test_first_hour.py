"""What a new user meets first: commands that need torch without torch, output through a pipe,
help text, and the lists of names a run spec may use (issue 20)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.runspec import gpu_catalog, model_presets

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.mark.parametrize(
    "args",
    [
        ["train", "examples/tiny-train.toml", "--run-dir", "{tmp}/run"],
        ["bench", "comm", "-C", "all_reduce"],
        ["bench", "gemm", "-s", "64"],
    ],
    ids=["train", "bench comm", "bench gemm"],
)
def test_commands_that_need_torch_say_so_in_one_line(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As after the README's first command (the planner alone): torch cannot be imported."""
    monkeypatch.setitem(sys.modules, "torch", None)  # any import of torch now fails
    monkeypatch.chdir(ROOT)
    res = runner.invoke(app, [a.format(tmp=tmp_path) for a in args])
    assert res.exit_code == 2, res.output
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: `aihpc ") and "pip install -e '.[torch]'" in line
    assert "download.pytorch.org/whl/cpu" in line  # not a CUDA build of several GB by default
    assert not (tmp_path / "run").exists()  # nothing was started


def test_output_through_a_pipe_is_whole(tmp_path: Path) -> None:
    """Piped (as to `tee` or a log), a table is as wide as its content: no header cut to '…', no
    line wrapped, even where the environment says the terminal has 80 columns."""
    spec = tmp_path / "run.toml"
    spec.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 64\n'
        "[parallel]\nglobal_batch_size = 128\n"
    )
    env = {**os.environ, "COLUMNS": "80"}
    r = subprocess.run(
        [sys.executable, "-m", "aihpc", "search", str(spec), "--top", "3", "--tokens", "15T"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout
    header = next(x for x in r.stdout.splitlines() if "tok/s/GPU" in x)
    for col in ("recompute", "tok/s/GPU", "MFU", "GiB", "ETTR", "days", "M GPU-hours"):
        assert f" {col} " in header
    assert len(header) > 80  # wider than the 80 columns it would have been cut to
    rows = [x for x in r.stdout.splitlines() if x.strip()[:1].isdigit()]
    assert len(rows) == 3 and all(x.split("│")[-1].strip() for x in rows)  # last column there


def test_estimate_line_is_not_wrapped_and_names_seq_and_tokens() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "aihpc", "estimate", str(ROOT / "examples" / "llama3-70b.toml")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "60"},
        stdin=subprocess.DEVNULL,
    )
    lines = r.stdout.splitlines()
    assert lines[0].endswith("· seq 8,192 · 4,194,304 tokens per step (512 sequences)")
    assert lines[1].startswith("plan: tp 8") and lines[1].endswith("gbs 512")
    assert lines[3].startswith("software:") and lines[3].endswith("(set in [training])")
    out = json.loads(
        runner.invoke(
            app, ["estimate", str(ROOT / "examples" / "llama3-70b.toml"), "--json"]
        ).stdout
    )
    assert out["seq_length"] == 8192 and out["tokens_per_step"] == 512 * 8192


def test_help_shows_no_value_placeholder_for_flags() -> None:
    for args in (["--help"], ["search", "--help"], ["bench", "comm", "--help"], ["gpus", "-h"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and "<bool>" not in res.stdout, (args, res.stdout)
    out = runner.invoke(app, ["search", "--help"]).stdout
    assert "RUNSPEC" in out and "{runspec}" not in out
    assert "--json " in out  # the flag is still listed


def test_presets_and_gpus_list_every_name_with_figures_and_sources() -> None:
    presets = json.loads(runner.invoke(app, ["presets", "--json"]).stdout)["presets"]
    assert [p["preset"] for p in presets] == sorted(model_presets())
    p70 = next(p for p in presets if p["preset"] == "llama3-70b")
    assert p70["num_layers"] == 80 and 70e9 < p70["params"] < 71e9 and "Llama" in p70["source"]
    gpus = json.loads(runner.invoke(app, ["gpus", "--json"]).stdout)["gpus"]
    assert [g["gpu"] for g in gpus] == sorted(gpu_catalog())
    h100 = next(g for g in gpus if g["gpu"] == "h100-sxm")
    assert h100["bf16_tflops"] == 989.0 and h100["hbm_gib"] > 79 and "datasheet" in h100["source"]
    table = runner.invoke(app, ["gpus"]).stdout
    assert all(gid in table for gid in gpu_catalog()) and "[cluster] gpu = NAME" in table
    assert all(name in runner.invoke(app, ["presets"]).stdout for name in model_presets())


def test_presets_show_the_experts_own_width_and_the_active_parameters() -> None:
    """An MoE preset's expert FFN width is its own (DeepSeek-V3: 2,048, not the dense layers'
    18,432); a model whose every layer is MoE has no dense FFN to show."""
    presets = json.loads(runner.invoke(app, ["presets", "--json"]).stdout)["presets"]
    ds = next(p for p in presets if p["preset"] == "deepseek-v3")
    assert (ds["ffn_hidden_size"], ds["expert_ffn_hidden_size"]) == (18432, 2048)
    assert 36e9 < ds["active_params"] < 38e9  # the report's 37B activated
    table = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["presets"]).stdout
    row = next(line for line in table.splitlines() if line.startswith(" deepseek-v3 "))
    assert "256 x 2,048 top 8 +1" in row and "18,432" in row and "37.55 B" in row
    mixtral = next(line for line in table.splitlines() if line.startswith(" mixtral-8x7b "))
    assert "8 x 14,336 top 2" in mixtral and "14,336 │" not in mixtral.split("8 x")[0]


@pytest.mark.parametrize(
    ("gpu", "answer"),
    [
        ("H100-SXM", None),  # any case: the catalog id
        ("h100", "did you mean 'h100-96gb-500w' or 'h100-sxm'"),
        ("mi300", "did you mean 'mi300x'"),
    ],
)
def test_gpu_names_in_any_case_or_did_you_mean(tmp_path: Path, gpu: str, answer: str | None):
    spec = tmp_path / "run.toml"
    spec.write_text(
        f'[model]\npreset = "Llama3-8B"\n[cluster]\ngpu = "{gpu}"\nnum_gpus = 8\n'
        '[parallel]\nglobal_batch_size = 8\nrecompute = "full"\n'
    )
    res = runner.invoke(app, ["estimate", str(spec), "--json"])
    if answer is None:
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["plan"]["dp"] == 8
    else:
        assert res.exit_code == 2 and answer in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_a_preset_set_to_its_own_values_is_not_modified(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    base = '[cluster]\ngpu = "h100-sxm"\nnum_gpus = 8\n[parallel]\nglobal_batch_size = 8\n'
    for extra, name in (
        ("num_layers = 32\nnum_experts = 0\n", "llama3-8b"),
        ("num_layers = 8\n", "llama3-8b (modified)"),
    ):
        spec.write_text(f'[model]\npreset = "llama3-8b"\n{extra}{base}')
        first = runner.invoke(app, ["estimate", str(spec)]).stdout.splitlines()[0]
        assert first.startswith(f"{name} on 8 × h100-sxm"), first


def test_a_utf8_bom_is_accepted(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_bytes(b"\xef\xbb\xbf" + (ROOT / "examples" / "llama3-70b.toml").read_bytes())
    assert runner.invoke(app, ["estimate", str(spec), "--json"]).exit_code == 0


def test_estimate_exits_1_when_the_plan_does_not_fit(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(
        '[model]\npreset = "llama3-70b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 8\n'
        "[parallel]\nglobal_batch_size = 8\n"
    )
    res = runner.invoke(app, ["estimate", str(spec)])
    assert res.exit_code == 1 and "does NOT fit" in res.stdout and "Bottleneck" in res.stdout
    res = runner.invoke(app, ["estimate", str(spec), "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["fits"] is False


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-C", "all_reduce", "--group", "inter"], "needs at least 2 nodes"),
        (["-C", "send_recv", "--group", "intra", "--ranks-per-node", "1"], "send_recv needs"),
        (["-C", "all_reduce", "--nproc-per-node", "3", "--ranks-per-node", "2"], "divide"),
        (["-C", "all_reduce", "-r", "5"], "-r/--root"),
        (["-C", "bogus"], "--collective"),
        (["-C", "all_reduce", "--output", "no/such/dir/x.json"], "does not exist"),
    ],
)
def test_bench_comm_flag_errors_come_before_any_process(
    args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answered by the command itself, before a worker is spawned (it used to be each worker's
    answer, 9-29 s later): the launcher is never reached."""
    import aihpc.bench.dist

    def no_launch(*_a: object, **_k: object) -> None:
        raise AssertionError("a worker was launched for a bad flag")

    monkeypatch.setattr(aihpc.bench.dist, "launch_local", no_launch)
    res = runner.invoke(app, ["bench", "comm", "--nproc-per-node", "2", *args])
    assert res.exit_code == 2 and needle in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1


def test_bench_gemm_out_of_memory_is_one_line() -> None:
    res = runner.invoke(app, ["bench", "gemm", "-s", "1000000x1000000x1000"])
    assert res.exit_code == 2, res.output
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: --shape = '1000000x1000000x1000': needs ") and "GiB" in line


def test_goodput_table_reads_as_words_with_thousands_separators() -> None:
    spec = ROOT / "examples" / "llama3-405b-16k.toml"
    out = runner.invoke(app, ["goodput", str(spec), "--tokens", "15.6T"]).stdout
    for text in ("expected interruptions", "time to train", "15.6T tokens", "2,000 GB/s", "ETTR"):
        assert text in out, text
    for key in ("expected_interruptions", "time_to_train_days", "lost_work", "1.56e+13"):
        assert key not in out, key


def test_goodput_plot_names_the_run_and_keeps_overlapping_lines_apart() -> None:
    from aihpc.goodput.plot import goodput_curves, goodput_figure
    from aihpc.runspec import load_runspec

    spec = load_runspec(ROOT / "examples" / "llama3-405b-16k.toml")
    counts = [1024, 16384]
    fig = goodput_figure(spec, counts, goodput_curves(spec, counts))
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "this run spec: 16,384 GPUs" in labels
    curves = [ln for ln in ax.get_lines() if ln.get_marker() not in (None, "None", "")]
    styles = {(ln.get_marker(), ln.get_linestyle()) for ln in curves}
    assert len(styles) == len(labels) - 1  # every strategy its own marker and line style
