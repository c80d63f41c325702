"""`aihpc infer` and `aihpc validate --inference`: the JSON contract, the search's ranking and
one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "serving" / "llama3-70b.toml"
DSV3 = ROOT / "examples" / "serving" / "deepseek-v3-decode.toml"


def aihpc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args], capture_output=True, text=True, timeout=300
    )


def test_serving_json_holds_the_latency_throughput_and_memory() -> None:
    r = aihpc("infer", str(LLAMA), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "serving"
    assert out["tpot_s"] > 0 and out["ttft_s"] > 0
    per_gpu = out["output_tokens_per_s"] / out["plan"]["gpus"]
    assert out["tokens_per_s_per_gpu"] == pytest.approx(per_gpu)
    assert out["tokens_per_s_per_request"] == pytest.approx(1 / out["tpot_s"])
    mem = out["memory"]
    assert mem["kv_cache_gib"] <= mem["kv_capacity_gib"]
    assert out["batch"] <= mem["max_batch"]
    assert out["bottleneck"].startswith(("decode is bound", "memory"))


def test_static_mode_and_options_override_the_table() -> None:
    r = aihpc("infer", str(LLAMA), "--mode", "static", "--batch", "8", "--tp", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["batch"] == 8 and out["plan"]["tp"] == 4
    assert out["ttft_s"] == pytest.approx(out["prefill_s"])
    assert out["tpot_s"] == pytest.approx(out["decode_step_s"])


def test_search_meets_the_target_and_ranks_by_throughput_per_gpu() -> None:
    r = aihpc("infer", str(LLAMA), "--search", "--tpot-ms", "40", "--json", "--top", "20")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    plans = out["plans"]
    assert plans, out
    assert all(p["tpot_s"] <= 0.040 + 1e-9 for p in plans)
    rates = [p["tokens_per_s_per_gpu"] for p in plans]
    assert rates == sorted(rates, reverse=True)
    assert all(p["plan"]["gpus"] <= 8 for p in plans)


def test_disaggregated_decode_with_large_ep() -> None:
    r = aihpc("infer", str(DSV3), "--mode", "disaggregated", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["decode"]["plan"]["ep"] == 144
    assert out["decode"]["step_terms"]["ep_comm_s"] > 0
    assert out["kv_transfer_s"] > 0
    assert out["ttft_s"] > out["kv_transfer_s"]


def test_validate_inference_reports_every_row_with_its_source() -> None:
    r = aihpc("validate", "--inference", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["rows"]) >= 25
    assert all(row["source"] for row in out["rows"])
    assert sum(row["heldout"] for row in out["rows"]) >= 5
    judged = [row for row in out["rows"] if row["judged"]]
    assert out["judged_rows"] == len(judged) >= 25
    errors = [abs(row["error"]) for row in judged]
    assert out["mape"] == pytest.approx(sum(errors) / len(errors))
    assert out["max_abs_error"] == pytest.approx(max(errors))
    # a row left out of the targets is still priced and printed, and says why
    aside = [row for row in out["rows"] if not row["judged"]]
    assert all(row["predicted_per_gpu"] > 0 and len(row["uncertainty"]) > 40 for row in aside)
    assert {row["engine"] for row in out["rows"]} >= {"default", "trtllm-0.5", "deepseek"}
    noted = [row for row in out["rows"] if row["uncertainty"]]
    assert noted and all(len(row["uncertainty"]) > 40 for row in noted)


def test_validate_inference_prints_each_rows_uncertainty_under_the_table() -> None:
    r = aihpc("validate", "--inference")
    assert r.returncode == 0, r.stderr
    marked = [line for line in r.stdout.splitlines() if line.startswith("| ") and "[1]" in line]
    assert len(marked) == 1
    assert any(line.startswith("[1] ") for line in r.stdout.splitlines())


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--tp", "3"], "inference.tp = 3"),
        (["--kv-dtype", "int2"], "inference.kv_dtype"),
        (["--ep", "2"], "inference.ep = 2"),  # a dense model
        (["--search"], "--tpot-ms"),
        (["--search", "--tpot-ms", "0"], "inference.tpot_ms"),
        (["--batch", "0"], "inference.batch"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], words: str) -> None:
    r = aihpc("infer", str(LLAMA), *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_a_bad_inference_table_is_refused_at_load(tmp_path: Path) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(LLAMA.read_text().replace('mode = "serving"', 'mode = "batchy"'))
    r = aihpc("infer", str(spec))
    assert r.returncode == 2
    assert "inference.mode" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_unknown_engine_is_one_line_naming_the_engines(tmp_path: Path) -> None:
    spec = tmp_path / "engine.toml"
    spec.write_text(
        LLAMA.read_text().replace('mode = "serving"', 'mode = "serving"\nengine = "vllm-9"')
    )
    r = aihpc("infer", str(spec))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "inference.engine" in lines[0] and "trtllm-0.5" in lines[0]
    ok = tmp_path / "old.toml"
    ok.write_text(
        LLAMA.read_text().replace('mode = "serving"', 'mode = "serving"\nengine = "trtllm-0.5"')
    )
    new = json.loads(aihpc("infer", str(LLAMA), "--json").stdout)
    old = json.loads(aihpc("infer", str(ok), "--json").stdout)
    assert old["plan"]["engine"]["name"] == "trtllm-0.5"
    assert old["tokens_per_s_per_gpu"] < new["tokens_per_s_per_gpu"]  # per-head KV reads
