"""The vocabulary layout: ids in the documented order, manifest round trip, and refusal of
shards whose layout does not match, with a message naming both layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pairforge.tokenizers.text import ByteTokenizer
from pairforge.tokenizers.vocab import VocabLayout, VocabMismatch

TEXT_FP = {"backend": "hf", "model": "/data/tok", "digest": "aaaa"}
IMAGE_FP = {"backend": "pairforge-vq", "model": "/data/vq", "resolution": 64, "digest": "bbbb"}


def layout(**changes) -> VocabLayout:
    values = dict(text_vocab_size=1000, image_codebook_size=512, text_tokenizer=TEXT_FP,
                  image_tokenizer=IMAGE_FP)
    return VocabLayout(**{**values, **changes})


def test_ids_are_text_then_image_then_specials() -> None:
    v = layout()
    assert v.image_offset == 1000
    assert (v.sov, v.eov, v.eos, v.pad) == (1512, 1513, 1514, 1515)
    assert v.total_size == 1516
    codes = np.array([[0, 511], [3, 4]], np.int32)
    ids = v.image_ids(codes)
    assert ids.dtype == np.int32 and ids.tolist() == [[1000, 1511], [1003, 1004]]
    assert np.array_equal(ids - v.image_offset, codes)  # codes sit at image_offset..sov
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        v.image_ids(np.array([512]))


def test_manifest_round_trip_through_json() -> None:
    v = layout()
    data = json.loads(json.dumps(v.to_manifest()))
    assert data["order"] == ["text", "image", "SOV", "EOV", "EOS", "PAD"]
    assert data["eos"] == 1514 and data["image_tokenizer"]["resolution"] == 64
    assert VocabLayout.from_manifest(data) == v


def test_manifest_with_inconsistent_ids_is_refused() -> None:
    data = layout().to_manifest()
    data["eos"] = 7
    with pytest.raises(VocabMismatch, match="disagree"):
        VocabLayout.from_manifest(data)


@pytest.mark.parametrize(("change", "named"), [
    ({"image_codebook_size": 1024}, "image codebook size"),
    ({"text_vocab_size": 256}, "text vocabulary size"),
    ({"text_tokenizer": {**TEXT_FP, "digest": "cccc"}}, "text tokenizer"),
    ({"image_tokenizer": {**IMAGE_FP, "digest": "dddd"}}, "image tokenizer"),
])
def test_mismatch_names_both_layouts(change: dict, named: str) -> None:
    with pytest.raises(VocabMismatch) as error:
        layout().check_compatible(layout(**change), this="model", that="shards")
    message = str(error.value)
    assert named in message
    assert "model: V_text=1000" in message and "shards: V_text=" in message
    assert "K=512" in message and "digest bbbb" in message


def test_same_tokenizers_from_other_paths_are_compatible() -> None:
    moved = layout(text_tokenizer={**TEXT_FP, "model": "hub/id"},
                   image_tokenizer={**IMAGE_FP, "model": "/elsewhere/vq"})
    layout().check_compatible(moved)


def test_layout_from_tokenizers() -> None:
    class FakeImage:  # only the two attributes the layout reads
        codebook_size = 64
        fingerprint = IMAGE_FP

    v = VocabLayout.from_tokenizers(ByteTokenizer(), FakeImage())
    assert (v.text_vocab_size, v.image_codebook_size, v.sov) == (256, 64, 320)
    assert v.text_tokenizer["backend"] == "bytes"
