"""Vision-language models through the CLI (issue 40): estimate and search of a VLM run spec,
validate --vlm, import hf of a VLM config.json, and bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from aihpc.cli import app

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vlm" / "qwen2.5-vl-72b.toml"


def _with_plan(tmp_path: Path, extra: str = "") -> Path:
    text = EXAMPLE.read_text().replace(
        "[parallel]\nglobal_batch_size = 256\n",
        "[parallel]\ntp = 8\npp = 4\ndp = 8\nmicro_batch_size = 1\nglobal_batch_size = 256\n"
        'sequence_parallel = true\nrecompute = "selective"\n',
    )
    path = tmp_path / "vlm.toml"
    path.write_text(text + extra)
    return path


def test_estimate_prints_the_encoder_terms(tmp_path: Path) -> None:
    spec = _with_plan(tmp_path)
    r = CliRunner().invoke(app, ["estimate", str(spec), "--json"])
    assert r.exit_code in (0, 1), r.output
    data = json.loads(r.stdout)
    assert data["placement"] == "tp" and data["encoder_tp"] == 8
    assert data["step_time_s"] > 0 and "encoder_imbalance" in data["time_s"]
    assert abs(sum(data["time_s"].values()) - data["step_time_s"]) < 1e-6 * data["step_time_s"]
    text = CliRunner().invoke(app, ["estimate", str(spec)]).stdout
    assert "encoder tp" in text and "samples/s/GPU" in text


def test_placement_in_the_spec_is_priced(tmp_path: Path) -> None:
    spec = _with_plan(tmp_path)
    spec.write_text(
        spec.read_text().replace("packing = true", 'packing = true\nplacement = "bubble"')
    )
    data = json.loads(CliRunner().invoke(app, ["estimate", str(spec), "--json"]).stdout)
    assert data["placement"] == "bubble"


def test_search_compares_placements() -> None:
    r = CliRunner().invoke(app, ["search", str(EXAMPLE), "--json", "--top", "3"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert len(data["plans"]) == 3
    assert {"tp", "replicated", "bubble"} <= set(data["best_by_placement"])
    text = CliRunner().invoke(app, ["search", str(EXAMPLE), "--top", "3"]).stdout
    assert "Best plan of each encoder placement" in text


def test_validate_vlm_reports_its_targets() -> None:
    r = CliRunner().invoke(app, ["validate", "--vlm", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["vlm"] is True and len(data["rows"]) >= 8
    assert data["targets"] == {"mape": 0.15, "max_abs_error": 0.30}
    last = CliRunner().invoke(app, ["validate", "--vlm"]).stdout.strip().splitlines()[-1]
    assert last.startswith("MAPE") and "targets 15% / 30%" in last


def test_validate_vlm_is_its_own_set() -> None:
    r = CliRunner().invoke(app, ["validate", "--vlm", "--moe"])
    assert r.exit_code == 2 and "--vlm" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_import_hf_reads_the_vision_encoder() -> None:
    cfg = ROOT / "examples" / "vlm" / "hf" / "llama-3.2-11b-vision.json"
    r = CliRunner().invoke(app, ["import", "hf", str(cfg), "--seq-length", "4096", "--json"])
    assert r.exit_code == 0, r.output
    model = json.loads(r.stdout)["runspec"]["model"]
    assert model["num_layers"] == 40 and model["vision"]["cross_attention_layers"] == 8
    assert model["vision"]["num_layers"] == 40 and model["vision"]["feature_layers"] == 6


def test_bad_multimodal_is_one_line_naming_the_field(tmp_path: Path) -> None:
    spec = _with_plan(tmp_path)
    spec.write_text(spec.read_text().replace("packing = true", "packing = true\nencoder_tp = -1"))
    r = CliRunner().invoke(app, ["estimate", str(spec)])
    assert r.exit_code == 2 and "multimodal.encoder_tp" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_bad_vlm_config_json_names_the_key(tmp_path: Path) -> None:
    cfg = json.loads((ROOT / "examples" / "vlm" / "hf" / "qwen2.5-vl-7b-instruct.json").read_text())
    cfg["vision_config"]["depth"] = "deep"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["import", "hf", str(path)])
    assert r.exit_code == 2 and "vision_config depth" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_presets_list_the_vision_language_models() -> None:
    from aihpc.runspec.vision import vlm_presets

    data = json.loads(CliRunner().invoke(app, ["presets", "--json"]).stdout)
    names = {r["preset"] for r in data["vlm_presets"]}
    assert names == set(vlm_presets())
    # Llama 3.2 Vision's model cards: 10.6B and 88.6B parameters in all
    rows = {r["preset"]: r for r in data["vlm_presets"]}
    for name, published in (("llama3.2-vision-11b", 10.6e9), ("llama3.2-vision-90b", 88.6e9)):
        r = rows[name]
        total = r["llm_params"] + r["encoder_params"] + r["projector_params"]
        assert abs(total - published) / published < 0.02, (name, total)
    text = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["presets"]).stdout
    assert "Vision-language presets" in text and "qwen2.5-vl-72b" in text


def test_search_options_a_vlm_spec_does_not_take_are_refused() -> None:
    for extra in (["--explain"], ["--for", "megatron"], ["--tokens", "1T"]):
        r = CliRunner().invoke(app, ["search", str(EXAMPLE), *extra])
        assert r.exit_code == 2 and extra[0] in r.stderr, (extra, r.output)
        assert len(r.stderr.strip().splitlines()) == 1


def test_export_refuses_a_vlm_spec_rather_than_drop_its_encoder() -> None:
    r = CliRunner().invoke(app, ["export", str(EXAMPLE), "--to", "megatron"])
    assert r.exit_code == 2 and "model.vision" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
