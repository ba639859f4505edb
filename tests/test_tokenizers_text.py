"""Text tokenizers: byte fallback, a BPE trained on captions and reloaded with
from_pretrained, Hugging Face tokenizers by path, caption readers, the train-text CLI."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from conftest import COCO_CAPTIONS
from typer.testing import CliRunner

from pairforge.tokenizers.cli import app
from pairforge.tokenizers.registry import load_text_tokenizer
from pairforge.tokenizers.text import ByteTokenizer, HFTextTokenizer, read_captions, train_bpe

TRICKY = "Ein Mädchen 🙂 hält einen Schirm\tnext to a yak — 漢字"


def captions() -> list[str]:
    """The 160 COCO captions kept with the test photos (tests/data/coco/captions.csv)."""
    return list(read_captions([COCO_CAPTIONS]))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(captions(), tmp_path_factory.mktemp("bpe") / "tok", vocab_size=600)


def test_byte_tokenizer_round_trips_anything() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TRICKY)
    assert tok.decode(ids) == TRICKY
    assert max(ids) < tok.vocab_size == 256
    assert load_text_tokenizer(None).fingerprint == tok.fingerprint


def test_trained_bpe_reloads_with_from_pretrained(bpe_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast.from_pretrained(str(bpe_dir))
    tok = load_text_tokenizer({"backend": "hf", "path_or_id": str(bpe_dir)})
    assert tok.vocab_size == len(fast) <= 600
    for text in captions()[:20] + [TRICKY]:
        ids = tok.encode(text)
        assert ids == fast(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text  # byte-level: nothing is unknown, nothing lost
        assert max(ids) < tok.vocab_size
    # merges learned from captions make them shorter than their bytes
    sample = captions()[0]
    assert len(tok.encode(sample)) < len(sample.encode()) / 2


def test_hf_fingerprint_follows_content_not_path(bpe_dir: Path, tmp_path: Path) -> None:
    tok = HFTextTokenizer(str(bpe_dir))
    copy = HFTextTokenizer(str(shutil.copytree(bpe_dir, tmp_path / "copy")))
    assert tok.fingerprint["digest"] == copy.fingerprint["digest"]
    assert tok.fingerprint["model"] != copy.fingerprint["model"]
    other = HFTextTokenizer(str(train_bpe(captions(), tmp_path / "small", vocab_size=300)))
    assert other.fingerprint["digest"] != tok.fingerprint["digest"]


def test_hf_backend_needs_a_path() -> None:
    with pytest.raises(ValueError, match="path_or_id"):
        load_text_tokenizer({"backend": "hf"})


def test_read_captions_from_tables_text_and_shards(tmp_path: Path) -> None:
    import webdataset as wds

    with (tmp_path / "a.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerows([["url", "caption"], ["u1", "first, with a comma"], ["u2", ""]])
    (tmp_path / "b.jsonl").write_text(json.dumps({"caption": "second"}) + "\n")
    (tmp_path / "c.txt").write_text("third\nfourth\n")
    with wds.TarWriter(str(tmp_path / "d.tar")) as sink:
        sink.write({"__key__": "000000000", "txt": b"fifth", "jpg": b"\xff"})
    found = list(read_captions([tmp_path / n for n in ("a.csv", "b.jsonl", "c.txt", "d.tar")]))
    assert found == ["first, with a comma", "second", "third", "fourth", "fifth"]


def test_cli_train_text(tmp_path: Path) -> None:
    source = tmp_path / "captions.txt"
    source.write_text("\n".join(captions()))
    out = tmp_path / "tok"
    result = CliRunner().invoke(app, ["train-text", str(source), "--out", str(out),
                                      "--vocab-size", "400"])
    assert result.exit_code == 0, result.output
    assert "tokens per caption" in result.output
    assert load_text_tokenizer({"backend": "hf", "path_or_id": str(out)}).vocab_size <= 400


@pytest.mark.parametrize("verb", ["train-text", "train-vq"])
def test_cli_names_a_missing_source(tmp_path: Path, verb: str) -> None:
    missing = tmp_path / "nowhere.csv"
    result = CliRunner().invoke(app, [verb, str(missing), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not (tmp_path / "o").exists()
