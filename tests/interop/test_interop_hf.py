"""``aihpc import hf CONFIG.json``: a Hugging Face config.json as a run spec whose model is named
from the config, that ``aihpc estimate`` and ``search`` read as written; ``export --to hf`` and
back gives the same model."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.interop._common import model_fields
from aihpc.runspec import load_runspec

DATA = Path(__file__).parent / "data"
runner = CliRunner()


def _config_in(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_a_hub_download_is_named_by_its_folder_and_estimated(tmp_path: Path) -> None:
    """Meta's Llama 3 8B config.json, in a hub download's folder, one layer short of the
    preset: the run spec's model is named "Meta-Llama-3-8B", and estimate prints that name."""
    config = json.loads((DATA / "llama3_8b_config.json").read_text())
    path = _config_in(tmp_path / "Meta-Llama-3-8B", {**config, "num_hidden_layers": 31})
    out = tmp_path / "run.toml"
    res = runner.invoke(
        app, ["import", "hf", str(path), "--num-gpus", "64", "--seq-length", "8192", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    spec = load_runspec(out)
    assert spec.model.name == "Meta-Llama-3-8B" and spec.model.num_layers == 31
    assert (spec.cluster.num_gpus, spec.plan().global_batch_size) == (64, 512)  # 4M tokens
    assert "about 4M tokens a step" in res.stderr
    est = runner.invoke(app, ["estimate", str(out)])
    assert est.output.startswith("Meta-Llama-3-8B on 64 × h100-sxm")


def test_the_name_transformers_wrote_wins_and_a_preset_shape_is_the_preset(tmp_path: Path) -> None:
    config = json.loads((DATA / "llama3_8b_config.json").read_text())
    named = {**config, "num_hidden_layers": 30, "_name_or_path": "acme/llama-30L-base"}
    res = runner.invoke(app, ["import", "hf", str(_config_in(tmp_path / "x", named)), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["runspec"]["model"]["name"] == "llama-30L-base"
    same = runner.invoke(app, ["import", "hf", str(DATA / "llama3_8b_config.json"), "--json"])
    doc = json.loads(same.stdout)["runspec"]
    assert doc["model"] == {"preset": "llama3-8b"}  # Meta's config is the preset's shape
    assert doc["cluster"] == {"gpu": "h100-sxm", "num_gpus": 8}  # one node by default


def test_export_to_hf_and_back_is_the_same_model(tmp_path: Path) -> None:
    spec_path = Path(__file__).resolve().parents[2] / "examples" / "tiny-moe-train.toml"
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    res = runner.invoke(app, ["export", str(spec_path), "--to", "hf", "-o", str(config)])
    assert res.exit_code == 0, res.output
    # what a config.json cannot say is named, and only that is lost
    lost = {"moe_router_bias_update_rate"}
    assert {n.split(" = ")[0].removeprefix("model.") for n in _notes(res.stderr)} == lost
    back = tmp_path / "back.toml"
    seq = load_runspec(spec_path).model.seq_length
    res = runner.invoke(
        app, ["import", "hf", str(config), "--seq-length", str(seq), "-o", str(back)]
    )
    assert res.exit_code == 0, res.output
    mine, theirs = (
        model_fields(load_runspec(spec_path).model),
        model_fields(load_runspec(back).model),
    )
    assert {k for k in mine if mine[k] != theirs[k]} == lost


def _notes(stderr: str) -> list[str]:
    line = next(x for x in stderr.splitlines() if x.startswith("note: not carried: "))
    return line.removeprefix("note: not carried: ").split("; ")


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("{not json", "CONFIG = "),
        ("[1, 2]", "expected a JSON object"),
        ('{"hidden_size": 64}', "CONFIG num_attention_heads = None: required in config.json"),
        ('{"hidden_size": "wide"}', "CONFIG hidden_size = 'wide': expected an integer"),
    ],
)
def test_a_bad_config_is_one_line_and_exit_2(tmp_path: Path, text: str, answer: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    out = tmp_path / "run.toml"
    res = runner.invoke(app, ["import", "hf", str(path), "-o", str(out)])
    assert res.exit_code == 2 and answer in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and not out.exists()


def test_the_folder_name_is_used_only_when_there_is_one(tmp_path: Path) -> None:
    from aihpc.interop.hf.reader import hf_model_name

    assert hf_model_name({"architectures": ["MixtralForCausalLM"]}, "config.json") == "Mixtral"
    assert hf_model_name({"model_type": "qwen3"}, "config.json") == "qwen3"
    assert hf_model_name({}, str(tmp_path / "Qwen3-8B" / "config.json")) == "Qwen3-8B"
    shutil.rmtree(tmp_path)


def test_json_and_output_together_write_the_file_too(tmp_path: Path) -> None:
    """-o names the file a command writes, --json what it prints: both at once do both."""
    out = tmp_path / "run.toml"
    src = str(DATA / "llama3_8b_config.json")
    res = runner.invoke(app, ["import", "hf", src, "--json", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["runspec"] == tomllib.loads(out.read_text())
