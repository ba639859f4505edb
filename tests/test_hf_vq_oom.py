"""The transformers VQ tokenizers (Chameleon, Janus, Emu3) back off on out-of-memory as
CLIP and our VQ do (``batching.FixedForward``): a forward that raises
``torch.OutOfMemoryError`` runs again at half the rows, and every row's codes equal those
of a run that never ran out. Real tiny models with random weights; the error is raised
from the model's own ``encode`` when it is handed more rows than a pretend card holds."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_vq as tiny
import torch
from PIL import Image

from pairforge.tokenizers.registry import load_image_tokenizer

SIZES = [(32, 32), (32, 32), (40, 40), (32, 32), (40, 40), (32, 32), (32, 32)]


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in SIZES]


@pytest.mark.parametrize("backend", ["chameleon", "janus", "emu3"])
def test_an_out_of_memory_forward_halves_and_every_row_keeps_its_codes(
        tmp_path, monkeypatch, backend: str) -> None:
    folder = tiny.save_vq(backend, tmp_path / backend)
    tok = load_image_tokenizer({"backend": backend, "path_or_id": str(folder),
                                "batch_size": 4})
    images = _images()
    expected = tok.encode(images)  # no out-of-memory: forwards of 4 rows
    real_encode = type(tok.vq).encode
    seen: list[int] = []

    def encode(vq, pixels, *args, **kwargs):  # noqa: ANN001, ANN202 - the model's signature
        seen.append(pixels.shape[0])
        if pixels.shape[0] > 1:  # a card that holds one row
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_encode(vq, pixels, *args, **kwargs)

    monkeypatch.setattr(type(tok.vq), "encode", encode)
    got = tok.encode(images)
    assert len(got) == len(images)
    for grid, want in zip(got, expected, strict=True):
        assert np.array_equal(grid, want)
    assert tok.batch_size == 1  # the actor keeps the size that fitted
    assert seen[:3] == [4, 2, 1] and set(seen[3:]) == {1}
    assert seen.count(1) == len(images)  # once a row at one row per forward


def test_out_of_memory_at_one_row_is_raised_not_swallowed(tmp_path, monkeypatch) -> None:
    folder = tiny.save_vq("chameleon", tmp_path / "chameleon")
    tok = load_image_tokenizer({"backend": "chameleon", "path_or_id": str(folder),
                                "batch_size": 2})

    def encode(vq, pixels, *args, **kwargs):  # noqa: ANN001, ANN202
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(type(tok.vq), "encode", encode)
    with pytest.raises(torch.OutOfMemoryError):
        tok.encode(_images()[:3])
