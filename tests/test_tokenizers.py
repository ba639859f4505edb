"""transformers VQ backends (Emu3, Janus, Chameleon) built from tiny configs with random
weights, saved with save_pretrained and loaded back by path through the same code a hub
id takes; plus the registry."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tiny_vq as tiny
from PIL import Image

from pairforge.tokenizers.base import state_dict_sha256
from pairforge.tokenizers.hf_vq import HFVQTokenizer
from pairforge.tokenizers.registry import load_image_tokenizer

SIZES = [(40, 60), (60, 40), (50, 50), (20, 80)]  # (height, width)


def noise_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_vq")
    return {b: str(tiny.save_vq(b, root / b)) for b in ("emu3", "janus", "chameleon")}


@pytest.fixture(scope="module")
def tokenizers(checkpoints: dict[str, str]) -> dict[str, HFVQTokenizer]:
    return {b: load_image_tokenizer({"backend": b, "path_or_id": p})
            for b, p in checkpoints.items()}


def test_emu3_grids_follow_smart_resize(tokenizers: dict[str, HFVQTokenizer]) -> None:
    tok = tokenizers["emu3"]
    grids = tok.encode(noise_images(SIZES))
    expected = [tok.grid_shape(w, h) for h, w in SIZES]
    assert [g.shape for g in grids] == expected
    assert all(g.dtype == np.int32 and g.min() >= 0 and g.max() < tok.codebook_size
               for g in grids)
    # landscape and portrait of the same image swap the grid's sides
    assert grids[0].shape == grids[1].shape[::-1]
    assert tok.variable_resolution and tok.downsample == 2


def test_emu3_token_count_depends_on_aspect_ratio(tokenizers: dict[str, HFVQTokenizer]) -> None:
    # within [min_pixels, max_pixels] the image keeps its size, so a 16x32 image has half
    # the area (and tokens) of a 32x32 one
    grids = tokenizers["emu3"].encode(noise_images([(32, 32), (16, 32), (32, 16)]))
    counts = [g.size for g in grids]
    assert counts == [256, 128, 128]
    assert grids[1].shape == (8, 16) and grids[2].shape == (16, 8)


def test_emu3_codes_do_not_depend_on_batch_companions(
        tokenizers: dict[str, HFVQTokenizer]) -> None:
    images = noise_images(SIZES)
    together = tokenizers["emu3"].encode(images)
    alone = [tokenizers["emu3"].encode([im])[0] for im in images]
    assert all(np.array_equal(a, b) for a, b in zip(together, alone, strict=True))


@pytest.mark.parametrize("backend", ["janus", "chameleon"])
def test_fixed_size_backends_give_square_grids(tokenizers: dict[str, HFVQTokenizer],
                                               backend: str) -> None:
    tok = tokenizers[backend]
    grids = tok.encode(noise_images(SIZES))
    assert [g.shape for g in grids] == [(16, 16)] * len(SIZES)
    assert tok.resolution == 32 and tok.downsample == 2 and tok.codebook_size == 64


@pytest.mark.parametrize("backend", ["janus", "chameleon"])
def test_fixed_size_batches_give_the_codes_of_the_bare_model(
        tokenizers: dict[str, HFVQTokenizer], backend: str) -> None:
    """Batches of 2 over 5 photos (the last one short): each image's codes are those of
    the bare processor and VQ on that image alone, in input order."""
    import torch

    tok = tokenizers[backend]
    images = noise_images(SIZES + [(30, 30)], seed=4)
    saved, tok.batch_size = tok.batch_size, 2
    try:
        grids = tok.encode(images)
    finally:
        tok.batch_size = saved
    for image, grid in zip(images, grids, strict=True):
        pixels = tok.processor([image], return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            bare = tok.vq.encode(pixels).image_tokens.view(16, 16)
        assert np.array_equal(grid, bare.numpy())


@pytest.mark.parametrize(("backend", "sizes"), [
    ("emu3", [(32, 32), (16, 32), (24, 30)]),  # sizes the processor keeps as they are
    ("janus", [(32, 32), (32, 32)]),
])
def test_decode_of_encode_has_the_input_shape(tokenizers: dict[str, HFVQTokenizer],
                                              backend: str, sizes: list[tuple[int, int]]) -> None:
    tok = tokenizers[backend]
    images = noise_images(sizes)
    decoded = tok.decode(tok.encode(images))
    assert [im.size for im in decoded] == [im.size for im in images]
    assert all(im.mode == "RGB" for im in decoded)


@pytest.mark.parametrize("backend", ["emu3", "janus", "chameleon"])
def test_images_of_any_mode_encode_as_their_rgb(tokenizers: dict[str, HFVQTokenizer],
                                                backend: str) -> None:
    """An RGB image goes to the processor as it is (no copy); grey, palette and alpha
    images are converted first, and give the codes of their RGB conversion."""
    rgb = noise_images([(40, 60)])[0]
    others = [rgb.convert("L"), rgb.convert("P"), rgb.convert("RGBA")]
    tok = tokenizers[backend]
    got = tok.encode([rgb, *others])
    want = tok.encode([rgb] + [im.convert("RGB") for im in others])
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert [im.mode for im in others] == ["L", "P", "RGBA"]  # the caller's images untouched


@pytest.mark.parametrize("backend", ["emu3", "janus", "chameleon"])
def test_empty_batch(tokenizers: dict[str, HFVQTokenizer], backend: str) -> None:
    assert tokenizers[backend].encode([]) == []


def test_chameleon_says_it_has_no_decoder(tokenizers: dict[str, HFVQTokenizer]) -> None:
    tok = tokenizers["chameleon"]
    assert not tok.has_decoder
    grids = tok.encode(noise_images([(32, 32)]))
    with pytest.raises(NotImplementedError, match="no decoder|only the encoder"):
        tok.decode(grids)


def test_janus_refuses_grids_it_cannot_decode(tokenizers: dict[str, HFVQTokenizer]) -> None:
    with pytest.raises(ValueError, match="16x16"):
        tokenizers["janus"].decode([np.zeros((8, 8), np.int32)])


def test_fingerprint_names_weights_and_preprocessing(tokenizers: dict[str, HFVQTokenizer],
                                                     checkpoints: dict[str, str],
                                                     tmp_path) -> None:
    fp = tokenizers["chameleon"].fingerprint
    assert fp["backend"] == "chameleon" and fp["model"] == checkpoints["chameleon"]
    assert fp["weights_sha256"] == state_dict_sha256(tokenizers["chameleon"].vq)
    assert fp["preprocessing"]["crop_size"] == {"height": 32, "width": 32}
    assert fp["preprocessing"]["rescale_factor"] == pytest.approx(0.0078)
    assert fp["preprocessing"]["source"] == "preprocessor_config.json"
    # same weights from another folder: same digest; other preprocessing: another digest
    copy = shutil.copytree(checkpoints["chameleon"], tmp_path / "copy")
    moved = load_image_tokenizer({"backend": "chameleon", "path_or_id": str(copy)})
    assert moved.fingerprint["digest"] == fp["digest"]
    resized = load_image_tokenizer({"backend": "chameleon", "path_or_id": str(copy),
                                    "resolution": 48})
    assert resized.fingerprint["digest"] != fp["digest"]
    assert resized.encode(noise_images([(50, 70)]))[0].shape == (24, 24)


def test_checkpoint_without_processor_uses_model_defaults(tmp_path) -> None:
    path = tiny.save_vq("janus", tmp_path / "janus", with_processor=False)
    tok = load_image_tokenizer({"backend": "janus", "path_or_id": str(path)})
    # Janus: num_patches (16) x downsample (2), pixels scaled to [-1, 1]
    assert tok.resolution == 32
    assert tok.fingerprint["preprocessing"]["source"] == "defaults for janus"
    assert tok.fingerprint["preprocessing"]["image_mean"] == [0.5, 0.5, 0.5]
    assert tok.encode(noise_images([(10, 30)]))[0].shape == (16, 16)


@pytest.mark.parametrize("backend", ["emu3", "chameleon"])
def test_full_model_checkpoint_loads_only_its_vq_weights(tmp_path, backend: str) -> None:
    path, full = tiny.save_full_model(backend, tmp_path / backend)
    tok = load_image_tokenizer({"backend": backend, "path_or_id": str(path)})
    assert tok.fingerprint["weights_sha256"] == state_dict_sha256(full.model.vqmodel)
    assert tok.encode(noise_images([(32, 32)]))[0].shape == (16, 16)


def test_wrong_checkpoint_kind_is_refused(checkpoints: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="not a emu3 checkpoint"):
        load_image_tokenizer({"backend": "emu3", "path_or_id": checkpoints["janus"]})
    with pytest.raises(ValueError):
        load_image_tokenizer({"backend": "dall-e", "path_or_id": checkpoints["janus"]})
