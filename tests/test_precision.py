"""Every model step's precision, batch shape and compile option (issue 49, item 2): ``dtype``
(auto: bfloat16 on GPU, float32 on CPU) for CLIP and tokenize as for the others,
``batch_size: auto`` and the forward that halves on out-of-memory without losing a row,
and ``compile``."""

from __future__ import annotations

from pathlib import Path

import golden
import numpy as np
import pytest
import torch
from PIL import Image

from pairforge.batching import FixedForward
from pairforge.config import ClipConfig, ConfigError, parse_config
from pairforge.filters.clip import ClipScorer

SAMPLE = Path(__file__).resolve().parents[1] / "pairforge" / "sample"


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> dict:
    return golden.tiny_clip(tmp_path_factory.mktemp("clip"), name="pf-precision-clip")


def _pictures(n: int) -> list[Image.Image]:
    return [Image.open(p).convert("RGB") for p in sorted((SAMPLE / "images").glob("*.png"))[:n]]


def test_a_forward_out_of_memory_halves_and_loses_no_row():
    seen: list[int] = []

    def forward(batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.shape[0])
        if batch.shape[0] > 4:  # what a card too small for 16 or 8 rows does
            raise torch.OutOfMemoryError("CUDA out of memory")
        return batch * 2

    rows = FixedForward(16, "test")
    batch = torch.arange(10, dtype=torch.float32).reshape(10, 1)
    out = rows(forward, batch)
    assert torch.equal(out, batch * 2)  # every row, in order
    assert rows.rows == 4 and seen == [16, 8, 4, 4, 4]  # 10 rows: chunks of 4, padded
    assert torch.equal(rows(forward, batch[:3]), batch[:3] * 2) and seen[-1] == 4
    one = FixedForward(1, "test")
    with pytest.raises(torch.OutOfMemoryError):
        one(lambda b: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")), batch)


def test_batch_size_auto_is_a_size_and_a_back_off():
    auto = ClipConfig(batch_size="auto")
    assert auto.call_rows == 256 and ClipConfig(batch_size=8).call_rows == 8
    with pytest.raises(ValueError, match="batch_size must be > 0 or auto"):
        ClipConfig(batch_size=0)


def test_clip_dtype_auto_is_float32_on_cpu_and_bfloat16_changes_the_floats(clip):
    pictures = _pictures(6)
    auto = ClipScorer(ClipConfig(**clip, batch_size=4)).embed_images(pictures)
    fp32 = ClipScorer(ClipConfig(**clip, batch_size=4, dtype="float32")).embed_images(pictures)
    bf16 = ClipScorer(ClipConfig(**clip, batch_size=4, dtype="bfloat16")).embed_images(pictures)
    assert np.array_equal(auto, fp32)
    assert not np.array_equal(bf16, fp32)  # autocast did run in bfloat16
    np.testing.assert_allclose(bf16, fp32, atol=0.05)  # and stays the same model


def test_clip_compile_gives_eager_scores(clip):
    pictures = _pictures(4)
    eager = ClipScorer(ClipConfig(**clip, batch_size=4))
    compiled = ClipScorer(ClipConfig(**clip, batch_size=4, compile=True))
    assert compiled.encode_image is not compiled.model.encode_image
    # the image tower only: each compile costs ~20 s on 2 cores, and the text tower's is
    # the same call
    np.testing.assert_allclose(compiled.embed_images(pictures), eager.embed_images(pictures),
                               atol=1e-5)


def test_an_image_tower_out_of_memory_halves_only_the_image_calls(clip):
    """Each CLIP tower keeps its own call size: a card that fits 8 texts but only 2 images
    a call halves the image calls alone (same embeddings), and texts still go 8 at once."""
    scorer = ClipScorer(ClipConfig(**clip, batch_size=8))
    pictures = _pictures(5)
    expected = scorer.embed_images(pictures)
    image_tower = scorer.encode_image

    def small_card(batch: torch.Tensor) -> torch.Tensor:
        if batch.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return image_tower(batch)

    scorer.encode_image = small_card
    np.testing.assert_allclose(scorer.embed_images(pictures), expected, atol=1e-5)
    scorer.embed_texts(["a red circle"] * 5)
    assert scorer.forwards["image"].rows == 2 and scorer.forwards["text"].rows == 8


def test_vq_dtype_is_in_its_fingerprint_only_below_float32():
    from pairforge.tokenizers.registry import load_image_tokenizer

    spec = {"backend": "pairforge-vq", "path_or_id": str(SAMPLE / "vq32"), "batch_size": 4}
    auto = load_image_tokenizer(spec)
    bf16 = load_image_tokenizer({**spec, "dtype": "bfloat16"})
    fp32 = load_image_tokenizer({**spec, "dtype": "float32"})
    assert auto.fingerprint == fp32.fingerprint and "dtype" not in auto.fingerprint
    assert bf16.fingerprint["dtype"] == "bfloat16"
    assert bf16.fingerprint["digest"] != fp32.fingerprint["digest"]
    pictures = _pictures(4)
    codes, low = auto.encode(pictures), bf16.encode(pictures)
    assert all(c.shape == lo.shape == (8, 8) for c, lo in zip(codes, low, strict=True))


def test_the_captioner_refuses_compile():
    with pytest.raises(ConfigError, match="recaption.compile"):
        parse_config({"input": {"path": "x"}, "process": {"recaption": {"compile": True}}})
