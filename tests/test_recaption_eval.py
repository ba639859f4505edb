"""``pairforge recaption-eval`` end to end (recaption/evaluate.py, issue 20).

The captioner is the small BLIP the package ships (pairforge/sample/captioner, taught the
scene world), the images are held-out scenes of the bundled sample whose exact captions
are the references; grounding runs a tiny random-weight OWL-ViT (test_grounding_detector)
with the scene world's shape nouns. Everything goes through the CLI.
"""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from test_grounding_detector import WORDS
from tiny_detector import save_tiny_detector
from typer.testing import CliRunner

import pairforge
from pairforge.cli import app
from pairforge.config import EvaluationConfig
from pairforge.recaption.cider import cider_d
from pairforge.recaption.evaluate import read_table

ROOT = Path(pairforge.__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "recaption_eval"
SAMPLE = ROOT / "pairforge" / "sample"


def run(argv: list[str]):  # noqa: ANN201
    return CliRunner().invoke(app, argv, env={"COLUMNS": "120"})


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> Path:
    return save_tiny_detector(tmp_path_factory.mktemp("owl") / "owlvit",
                              WORDS + ["a photo of a circle square triangle cross"])


def _example_rows() -> list[dict]:
    with open(EXAMPLE / "scenes.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_example_table_per_background_and_object_count(tmp_path):
    """The shipped example: the taught captioner writes every held-out scene's exact
    caption, so CIDEr-D is 10 (its maximum) in every stratum and no gap exists."""
    out = tmp_path / "eval.json"
    result = run(["recaption-eval", str(EXAMPLE / "config.yaml"), str(EXAMPLE / "scenes.csv"),
                  "--json", str(out), "-q",
                  "--set", f"process.recaption.model={SAMPLE / 'captioner'}"])
    assert result.exit_code == 0, result.output
    assert "captions by background" in result.stdout and "captions by objects" in result.stdout
    data = json.loads(out.read_text())
    assert data["overall"] == {"rows": 60, "captions": 60, "cider_d": 10.0,
                               "hallucination": None, "specificity": None,
                               "abstention": 0.0}
    groups = data["strata"]["background"]["groups"]
    assert {k: (g["rows"], g["cider_d"]) for k, g in groups.items()} == {
        "black": (13, 10.0), "grey": (25, 10.0), "white": (22, 10.0)}
    assert {k: g["rows"] for k, g in data["strata"]["objects"]["groups"].items()} == {
        "1": 23, "2": 37}
    assert data["strata"]["objects"]["gap"] == {"cider_d": 0.0, "hallucination": None,
                                                "specificity": None, "abstention": 0.0}
    assert data["exceeded"] == []
    rows = _example_rows()
    assert [s["image"] for s in data["samples"]] == [r["image"] for r in rows]
    assert [s["caption"] for s in data["samples"]] == [r["reference"] for r in rows]


def _table(tmp_path: Path, n: int = 8) -> Path:
    """n held-out scenes: the first half with their exact captions as references, the
    second half with the next scene's caption (a wrong reference: a stratum the captioner
    cannot match)."""
    rows = _example_rows()[:n]
    path = tmp_path / "refs.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "reference", "refs"])
        for i, row in enumerate(rows):
            wrong = i >= n // 2
            reference = rows[(i + 1) % n]["reference"] if wrong else row["reference"]
            writer.writerow([str(EXAMPLE / row["image"]), reference,
                             "wrong" if wrong else "exact"])
    return path


def _config(tmp_path: Path, detector: Path, min_score: float, **evaluation) -> Path:
    nouns = EXAMPLE / "scene_nouns.txt"
    cfg = {"input": {"path": "unused"},
           "process": {"recaption": {
               "model": str(SAMPLE / "captioner"), "max_new_tokens": 24, "batch_size": 3,
               "prompt_mode": "none",
               "grounding": {"backend": "detector", "extra_nouns": [str(nouns)],
                             "detector": {"model": str(detector), "min_score": min_score}}}},
           "evaluation": {"strata": ["refs"], "min_rows": 2, **evaluation}}
    path = tmp_path / f"eval-{min_score}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_gap_past_its_bound_fails_and_grounding_is_measured(tmp_path, detector):
    table = _table(tmp_path)
    out = tmp_path / "gap.json"
    result = run(["recaption-eval", str(_config(tmp_path, detector, 0.0)), str(table),
                  "--max-gap", "cider_d=1.5", "--json", str(out)])
    assert result.exit_code == 1, result.output
    data = json.loads(out.read_text())
    exact, wrong = (data["strata"]["refs"]["groups"][k] for k in ("exact", "wrong"))
    # every noun is supported at min_score 0: nothing hallucinated, nothing abstained
    for group in (exact, wrong):
        assert (group["rows"], group["captions"]) == (4, 4)
        assert group["hallucination"] == 0.0 and group["abstention"] == 0.0
    # the exact half: CIDEr-D's maximum; the wrong half: the same captions scored against
    # other scenes' captions
    assert exact["cider_d"] == 10.0
    assert wrong["cider_d"] == 1.1594
    # ... the mean of the wrong half's scores with the whole table as the corpus
    samples = data["samples"]
    scores = cider_d([s["caption"] for s in samples], [s["references"] for s in samples])
    assert wrong["cider_d"] == pytest.approx(sum(scores[4:]) / 4, abs=1e-4)
    gap = data["strata"]["refs"]["gap"]
    assert gap["cider_d"] == pytest.approx(10.0 - 1.1594, abs=1e-4)
    assert data["exceeded"] == [{"stratum": "refs", "metric": "cider_d",
                                 "gap": gap["cider_d"], "bound": 1.5}]
    assert "refs: the cider_d gap between strata is 8.8406, over the bound 1.5" in (
        " ".join(result.stderr.split()))
    # specificity: the distinct object nouns of each caption ("a small red square above a
    # small yellow square" names one), counted here from the captions themselves; "orange"
    # counts: the noun list is COCO's, where an orange is a fruit (matching has no parts of
    # speech, a known limit of grounding by word lists)
    shapes = ("circle", "square", "triangle", "cross", "orange")
    for name, group in (("exact", exact), ("wrong", wrong)):
        captions = [s["caption"].lower() for s in data["samples"] if s["refs"] == name]
        expected = sum(sum(s in c for s in shapes) for c in captions) / len(captions)
        assert group["specificity"] == pytest.approx(expected, abs=1e-4)
    assert exact["specificity"] == 1.75 and wrong["specificity"] == 1.5
    # without the bound the same figures pass
    assert run(["recaption-eval", str(_config(tmp_path, detector, 0.0)), str(table),
                "-q"]).exit_code == 0


def test_unsupported_nouns_are_hallucinations_and_abstentions(tmp_path, detector):
    """At min_score 1 no box supports any noun: every caption names an unsupported
    object, is regenerated, fails again and abstains, in both strata alike (no gap)."""
    out = tmp_path / "abstain.json"
    result = run(["recaption-eval", str(_config(tmp_path, detector, 1.0)),
                  str(_table(tmp_path)), "--json", str(out), "-q"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    for group in data["strata"]["refs"]["groups"].values():
        assert group == {"rows": 4, "captions": 0, "cider_d": None, "hallucination": 1.0,
                         "specificity": None, "abstention": 1.0}
    assert data["strata"]["refs"]["gap"] == {"cider_d": None, "hallucination": 0.0,
                                             "specificity": None, "abstention": 0.0}
    for sample in data["samples"]:
        assert sample["caption"] is None and sample["cider_d"] is None
        assert any(f.startswith("regenerated:ungrounded:") for f in sample["flags"])
        assert any(f.startswith("abstained:ungrounded:") for f in sample["flags"])


def test_small_strata_are_reported_but_not_held_to_the_bound(tmp_path, detector):
    out = tmp_path / "small.json"
    result = run(["recaption-eval", str(_config(tmp_path, detector, 0.0, min_rows=5)),
                  str(_table(tmp_path)), "--max-gap", "cider_d=1.5", "--json", str(out),
                  "-q"])
    assert result.exit_code == 0, result.output
    assert "(few rows)" in result.stdout
    assert json.loads(out.read_text())["strata"]["refs"]["gap"]["cider_d"] is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--stratum", "region"], "has no column region (its columns: image, reference, refs)"),
    (["--max-gap", "bleu=0.1"], "--max-gap expects METRIC=VALUE with METRIC one of cider_d"),
    (["--max-gap", "abstention=lots"], "'lots' is not a number"),
])
def test_user_errors_are_named_before_any_model_loads(tmp_path, argv, message):
    config = tmp_path / "c.yaml"
    # a captioner that does not exist: a user error must come before any model is asked for
    config.write_text(yaml.safe_dump({"input": {"path": "x"}, "process": {"recaption": {
        "model": str(tmp_path / "no-model")}}, "evaluation": {"strata": ["refs"]}}))
    result = run(["recaption-eval", str(config), str(_table(tmp_path)), *argv])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert message in " ".join(result.stderr.split())


def test_missing_images_and_models_are_user_errors(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("image,reference\nnot-there.png,a cat\nhttp://x/y.png,a dog\n")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"input": {"path": "x"}, "process": {"recaption": {
        "model": str(tmp_path / "no-model")}}}))
    result = run(["recaption-eval", str(config), str(table)])
    assert result.exit_code == 2
    text = " ".join(result.stderr.split())
    assert "row 1: 'not-there.png' is not a local image file" in text
    assert "row 2: 'http://x/y.png' is not a local image file" in text
    good = _table(tmp_path)
    result = run(["recaption-eval", str(config), str(good)])
    assert result.exit_code == 2
    assert "process.recaption.model:" in result.stderr and "is not a folder" in result.stderr


def test_parquet_and_jsonl_tables_with_several_references(tmp_path):
    rows = _example_rows()[:3]
    records = [{"image": str(EXAMPLE / r["image"]), "refs": [r["reference"], "a picture"],
                "extra": None, "bg": r["background"]} for r in rows]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "t.parquet")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = EvaluationConfig(reference_cols=["refs", "extra"])
    (tmp_path / "t.json").write_text(json.dumps(records))
    for name in ("t.parquet", "t.jsonl", "t.json"):
        table = read_table(tmp_path / name, cfg, ["bg"])
        assert [r.references for r in table] == [[r["reference"], "a picture"] for r in rows]
        assert [r.strata for r in table] == [{"bg": r["background"]} for r in rows]


def test_a_compressed_tsv_keeps_its_strata_as_text(tmp_path):
    rows = _example_rows()[:2]
    lines = ["image\treference\tgroup"] + [f"{EXAMPLE / r['image']}\t{r['reference']}\t0{i}"
                                            for i, r in enumerate(rows)]
    with gzip.open(tmp_path / "t.tsv.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    table = read_table(tmp_path / "t.tsv.gz", EvaluationConfig(), ["group"])
    assert [r.strata for r in table] == [{"group": "00"}, {"group": "01"}]
    assert [r.references for r in table] == [[r["reference"]] for r in rows]
