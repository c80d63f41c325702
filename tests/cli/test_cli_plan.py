"""The planning CLI: JSON contract and one-line errors with exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama3-70b.toml"
KEYS = {
    "fits",
    "step_time_s",
    "tokens_per_s_per_gpu",
    "model_tflops_per_gpu",
    "mfu",
    "hfu",
    "memory_gib",
    "time_s",
    "plan",
}


def aihpc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args], capture_output=True, text=True, timeout=120
    )


def test_estimate_json_contract() -> None:
    r = aihpc("estimate", str(EXAMPLE), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out.keys() >= KEYS
    mem = out["memory_gib"]
    parts = sum(v for k, v in mem.items() if k != "total")
    assert mem["total"] == pytest.approx(parts)
    assert sum(out["time_s"].values()) == pytest.approx(out["step_time_s"])
    assert out["plan"]["dp"] == 1024 // (8 * 4)
    n, gbs, s = 1024, out["plan"]["global_batch_size"], 8192
    assert out["tokens_per_s_per_gpu"] == pytest.approx(gbs * s / out["step_time_s"] / n)
    assert 0 < out["mfu"] <= out["hfu"] < 1


def estimate_human(spec: Path, fits: bool = True) -> subprocess.CompletedProcess:
    """`aihpc estimate` with its rich output at 200 columns; asserts it answered, with exit 0
    for a plan that fits and 1 (after the whole estimate) for one that does not."""
    r = subprocess.run(
        [sys.executable, "-m", "aihpc", "estimate", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert r.returncode == (0 if fits else 1), r.stderr
    assert ("does NOT fit" in r.stdout) != fits and r.stdout.rstrip().splitlines()[-1].startswith(
        "goodput:"
    )
    return r


def test_estimate_names_the_software_it_assumed(tmp_path: Path) -> None:
    """The human output says which [training] facts it priced, and follows the run spec."""
    spec = tmp_path / "run.toml"
    spec.write_text(
        EXAMPLE.read_text().replace(
            'optimizer = "adamw"',
            'optimizer = "adamw"\nattention = "flash2"\ncross_entropy = "eager"',
        )
    )
    r = estimate_human(spec)
    line = next(x for x in r.stdout.splitlines() if x.startswith("software:"))
    assert "attention flash2" in line and "cross-entropy eager" in line
    assert "[training]" in line


def test_estimate_shows_offloaded_layers_their_copies_and_host_memory(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(
        '[model]\npreset = "llama3-70b"\n[cluster]\ngpu = "gb200"\nnum_gpus = 64\n'
        '[parallel]\ntp = 1\npp = 1\nzero_stage = 3\nrecompute = "none"\noffload_layers = 40\n'
        'micro_batch_size = 2\nglobal_batch_size = 256\n[training]\nprecision = "fp8"\n'
    )
    lines = estimate_human(spec, fits=False).stdout.splitlines()
    assert any(x.startswith("plan:") and "offload 40 layers" in x for x in lines)
    assert any("activation offload copies (exposed)" in x for x in lines)
    host = next(x for x in lines if "offloaded to host memory" in x)
    assert host.split()[-1] == "224"  # of the Grace's 480 GB shared by two GPUs, in GiB


def test_estimate_shows_fsdp_gradients_made_after_the_peak(tmp_path: Path) -> None:
    """One micro-batch per step under FSDP2: the shards made in the backward are listed under
    the table and in the JSON, outside the total; with two micro-batches there are none."""
    spec = tmp_path / "run.toml"
    text = (
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 8\n'
        '[parallel]\nzero_stage = 3\nrecompute = "op"\nmicro_batch_size = 2\n'
        "global_batch_size = {gbs}\n"
    )
    spec.write_text(text.format(gbs=16))
    row = next(x for x in estimate_human(spec).stdout.splitlines() if "made after the peak" in x)
    one = json.loads(aihpc("estimate", str(spec), "--json").stdout)
    assert float(row.split()[-1]) == pytest.approx(one["gradients_after_peak_gib"], abs=0.05)
    spec.write_text(text.format(gbs=32))
    two = json.loads(aihpc("estimate", str(spec), "--json").stdout)
    assert two["gradients_after_peak_gib"] == 0.0
    later = one["memory_gib"]["gradients"] + one["gradients_after_peak_gib"]
    assert later == pytest.approx(two["memory_gib"]["gradients"], rel=1e-9)


def test_estimate_says_when_a_communicator_is_capped(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(
        '[model]\npreset = "llama3-8b"\nseq_length = 32768\n'
        '[cluster]\ngpu = "b200"\nnum_gpus = 64\n'
        "[parallel]\ntp = 1\ncp = 2\npp = 2\nglobal_batch_size = 64\n"
        "[training]\ncp_comm_ctas = 1\npp_comm_ctas = 2\n"
    )
    r = estimate_human(spec)
    text = " ".join(r.stdout.split())  # the software line may wrap
    assert "CP K/V ring on 1 CTA ·" in text and "sends on 2 CTAs" in text


def test_search_json_contract(tmp_path: Path) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 64\n'
        "[parallel]\nglobal_batch_size = 128\n"
    )
    r = aihpc("search", str(spec), "--json", "--top", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"plans", "evaluated", "feasible", "elapsed_s"}
    assert len(out["plans"]) == 3 and out["feasible"] >= 3
    assert out["plans"][0].keys() >= KEYS


BAD = {
    "unknown field": ('[model]\npreset = "llama3-8b"\nhiden_size = 1\n', "model.hiden_size"),
    "unknown preset": ('[model]\npreset = "llama9"\n', "model.preset"),
    "unknown gpu": (
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h1000"\nnum_gpus = 8\n',
        "cluster.gpu",
    ),
    "degrees do not divide": ("[parallel]\ntp = 8\npp = 3\nglobal_batch_size = 64\n", "parallel"),
    "heads vs tp": ("[parallel]\ntp = 64\nglobal_batch_size = 64\n", "parallel.tp"),
    "batch vs dp": ("[parallel]\ntp = 8\nglobal_batch_size = 100\n", "parallel.global_batch_size"),
    "bad enum": ('[parallel]\nrecompute = "some"\nglobal_batch_size = 64\n', "parallel.recompute"),
    "fp8 on a100": ('[training]\nprecision = "fp8"\n', "training.precision"),
    "negative memory": ("[cluster.gpu_spec]\nhbm_gib = -1\n", "cluster.gpu_spec"),
    "cta cap on a part without the channel figure": (
        '[cluster]\ngpu = "mi300x"\nnum_gpus = 64\n'
        "[parallel]\ntp = 2\ncp = 4\nglobal_batch_size = 8\n[training]\ncp_comm_ctas = 1\n",
        "training.cp_comm_ctas = 1: GPU 'mi300x' has no p2p_channel_bw_GBps",
    ),
    "offloading on a part without the host-link figure": (
        '[cluster]\ngpu = "mi300x"\nnum_gpus = 64\n'
        '[parallel]\nrecompute = "none"\noffload_layers = 4\nglobal_batch_size = 64\n',
        "parallel.offload_layers = 4: GPU 'mi300x' has no host_link_GBps",
    ),
    "offloading under pipeline parallelism": (
        '[parallel]\npp = 2\nrecompute = "none"\noffload_layers = 4\nglobal_batch_size = 64\n',
        "parallel.offload_layers",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_line(case: str, tmp_path: Path) -> None:
    snippet, field = BAD[case]
    base = {
        "model": '[model]\npreset = "llama3-8b"\n',
        "cluster": '[cluster]\ngpu = "a100-80gb"\nnum_gpus = 64\n',
        "parallel": "[parallel]\ntp = 8\nglobal_batch_size = 64\n",
    }
    for section in base:
        if f"[{section}" in snippet:
            base[section] = ""
    if "[cluster.gpu_spec]" in snippet:
        base["cluster"] = '[cluster]\ngpu = "a100-80gb"\nnum_gpus = 64\n'
    text = "".join(base.values()) + snippet
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    r = aihpc("estimate", str(spec), "--json")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert field in lines[0] and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_search_with_nothing_fitting_exits_2(tmp_path: Path) -> None:
    spec = tmp_path / "huge.toml"
    spec.write_text(
        '[model]\npreset = "llama3-405b"\n[cluster]\ngpu = "a100-40gb"\nnum_gpus = 8\n'
        "[parallel]\nglobal_batch_size = 8\n"
    )
    r = aihpc("search", str(spec), "--json")
    assert r.returncode == 2
    assert "fits" in r.stderr and "Traceback" not in r.stderr


def test_missing_file_exits_2() -> None:
    r = aihpc("estimate", "no-such-file.toml")
    assert r.returncode == 2 and "file not found" in r.stderr


def test_validate_rejects_malformed_tables(tmp_path: Path) -> None:
    missing = tmp_path / "runs.csv"
    missing.write_text("id,model\nX1,foo\n")
    r = aihpc("validate", "--runs", str(missing))
    assert r.returncode == 2 and "required columns are missing" in r.stderr
    assert "Traceback" not in r.stderr
    empty_memory = tmp_path / "memory.csv"
    empty_memory.write_text(
        "id,config_row,source,weights_and_optimizer_gib,"
        "activations_no_recompute_no_sp_gib,activations_sp_selective_gib\n"
    )
    r = aihpc("validate", "--memory", str(empty_memory))
    assert r.returncode == 2 and "no rows" in r.stderr


def test_validate_reports_each_target() -> None:
    """--json gives every target's verdict; the text names the rows over the worst-row limit."""
    r = aihpc("validate", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    met = data["targets_met"]
    assert set(met) == {"mape", "max_abs_error", "korthikanti_memory", "torchtitan_memory"}
    assert data["passed"] == all(met.values())
    assert met["mape"] == (data["mape"] <= data["targets"]["mape"])
    over = [row["id"] for row in data["rows"] if abs(row["error"]) > 0.25]
    text = aihpc("validate").stdout.strip().splitlines()[-1]
    assert text.startswith("Targets ")
    for row_id in over:
        assert row_id in text


def test_validate_heldout_runs_and_refuses_mixed_inputs(tmp_path: Path) -> None:
    """--heldout prices the held-out runs, and the peak memory of those that publish it, and
    says the targets are not theirs; combining it with --runs is refused with exit 2 and one
    line."""
    r = aihpc("validate", "--heldout", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["heldout"] is True
    ids = {row["id"] for row in data["rows"]}
    assert {"L1", "N1", "T1", "M01", "C01", "C17", "P01", "P18", "S1", "F1"} <= ids
    assert all(row["predicted_tokens_per_s_per_gpu"] > 0 for row in data["rows"])
    # only the rows with a published memory figure (Trainy's H200 runs, torchtitan's 405B CP
    # series) get a memory row
    assert {m["id"] for m in data["memory"]} == {"T9", "T10", "T11", "T12"}
    text = aihpc("validate", "--heldout").stdout
    assert "Held-out rows, outside the shared set" in text
    assert "| T9 | peak_reserved (torchtitan) |" in text
    runs = tmp_path / "runs.csv"
    runs.write_text("id\n")
    r = aihpc("validate", "--heldout", "--runs", str(runs))
    assert r.returncode == 2 and "--runs" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_help_keeps_the_table_names() -> None:
    """Help text is rich markup: the run spec's "[model]"-style table names must survive it."""
    text = aihpc("search", "--help").stdout  # single tokens: the help wraps at any width
    assert all(f"[{table}]" in text for table in ("parallel", "model", "cluster", "training"))
    assert "[cluster]" in aihpc("calibrate", "--help").stdout
    assert "[reliability]" in aihpc("goodput", "--help").stdout


def test_error_line_prints_brackets_as_written(tmp_path: Path) -> None:
    """A message naming a TOML table ("[model]") reaches stderr intact, not eaten as markup."""
    spec = tmp_path / "run.toml"
    spec.write_text('[cluster]\ngpu = "h100-sxm"\nnum_gpus = 8\n')
    r = aihpc("estimate", str(spec))
    assert r.returncode == 2
    assert "a [model] table" in r.stderr and len(r.stderr.strip().splitlines()) == 1
