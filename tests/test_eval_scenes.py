"""`pairforge eval RUN`: adherence and caption accuracy of a run on the scene world."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

import pairforge
from pairforge.cli import app
from pairforge.scenes.evaluate import KEYS
from pairforge.tokenizers.text import ByteTokenizer
from pairforge.tokenizers.vocab import VocabLayout
from pairforge.train.config import parse_train_config
from pairforge.train.loop import CHECKPOINT
from pairforge.train.model import Transformer

VQ = Path(pairforge.__file__).parent / "sample" / "vq32"


def _run_folder(tmp_path: Path) -> Path:
    """A run of a random-weight model on a (shard-less) scene-world dataset: what eval
    reads is the checkpoint and the dataset's manifest (tokenizers and layout)."""
    from pairforge.tokenizers.registry import load_image_tokenizer

    image = load_image_tokenizer({"backend": "pairforge-vq", "path_or_id": str(VQ)})
    layout = VocabLayout.from_tokenizers(ByteTokenizer(), image)
    data = tmp_path / "data"
    data.mkdir()
    manifest = {"vocab": layout.to_manifest(),
                "shards": [{"name": "00000.tar"}, {"name": "00001.tar"}],
                "config": {"process": {"tokenize": {
                    "image": {"backend": "pairforge-vq", "path_or_id": str(VQ)},
                    "text": {"backend": "bytes"}}}}}
    (data / "manifest.json").write_text(json.dumps(manifest))
    cfg = parse_train_config({"data": {"path": str(data)},
                              "model": {"d_model": 32, "n_layers": 1, "n_heads": 2,
                                        "max_seq_len": 160}})
    torch.manual_seed(0)
    model = Transformer(cfg.model, layout.total_size)
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"model": model.state_dict(), "config": cfg.model_dump(mode="json"),
                "layout": layout.to_manifest()}, run / CHECKPOINT)
    return run


def test_eval_verb_prints_a_table_and_writes_json(tmp_path):
    run = _run_folder(tmp_path)
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", str(run), "--prompts", "5", "--captions", "4",
                                      "--cfg-scale", "3.0", "--json", str(out),
                                      "--sheet", str(tmp_path / "s.png")])
    assert result.exit_code == 0, result.output
    assert "adherence (5)" in result.output and "caption_accuracy (4)" in result.output
    report = json.loads(out.read_text())
    assert report["adherence"]["n"] == 5 and report["caption_accuracy"]["n"] == 4
    for name in ("adherence", "caption_accuracy"):
        assert all(0.0 <= report[name][k] <= 1.0 for k in KEYS)
    # an untrained model's byte soup parses as no caption of the world
    assert report["caption_accuracy"]["all"] == 0.0
    assert len(report["adherence"]["examples"]) == 5
    assert (tmp_path / "s.png").stat().st_size > 0
    again = tmp_path / "again.json"
    CliRunner().invoke(app, ["eval", str(run), "--prompts", "5", "--captions", "4",
                             "--cfg-scale", "3.0", "--json", str(again)])
    assert json.loads(again.read_text())["adherence"] == report["adherence"]  # seeded


def test_eval_chooses_the_guidance_scale_on_validation_prompts(tmp_path, monkeypatch):
    """Several scales: each is tried on the validation scenes (not the measured ones) and
    the best all-attribute adherence wins, ties going to the smaller scale."""
    from pairforge.scenes import evaluate

    monkeypatch.setattr(evaluate, "VALIDATION_PROMPTS", 6)
    run = _run_folder(tmp_path)
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", str(run), "--prompts", "4", "--captions", "2",
                                      "--cfg-scale", "3.0", "--cfg-scale", "1.5",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    drawn = json.loads(out.read_text())["adherence"]
    # a random-weight model draws nothing right at any scale: the tie goes to 1.5
    assert drawn["validation_by_scale"] == {"1.5": 0.0, "3.0": 0.0}
    assert drawn["cfg_scale"] == 1.5 and "guidance scale 1.5 (chosen on" in result.output


def test_eval_and_sample_name_a_folder_that_is_not_a_run(tmp_path):
    for verb in (["eval"], ["sample"]):
        result = CliRunner().invoke(app, [*verb, str(tmp_path)])
        assert result.exit_code == 2, result.output
        assert f"{tmp_path / CHECKPOINT} does not exist" in " ".join(result.output.split())
        assert "Traceback" not in result.output
