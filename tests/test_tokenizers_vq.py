"""Our VQ-VAE: trains for a few steps, improves reconstruction, uses more than one code,
saves a checkpoint that loads like any other backend; reads folders and raw shards."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import COCO_IMAGES
from PIL import Image
from typer.testing import CliRunner

from pairforge.tokenizers import vqvae
from pairforge.tokenizers.cli import app
from pairforge.tokenizers.registry import load_image_tokenizer
from pairforge.tokenizers.train_vq import iter_image_bytes, train_vq


def sample_images_dir() -> Path:
    """The repository's COCO test photos (see tests/data/README.md)."""
    return COCO_IMAGES


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("vq") / "ckpt"
    metrics = train_vq(sample_images_dir(), out, resolution=32, codebook_size=64,
                       steps=120, batch_size=16, lr=3e-3, max_images=64, holdout=0.25,
                       seed=0, num_threads=1, log=None)
    return out, metrics


def test_training_improves_reconstruction_and_uses_many_codes(trained) -> None:
    _, metrics = trained
    assert metrics["psnr"] > metrics["before"]["psnr"] + 3.0
    assert metrics["codes_used"] > 1
    assert metrics["codebook_usage"] > 0.25  # EMA + restarts keep the codebook alive
    assert metrics["held_out_images"] == 16 and metrics["train_images"] == 48


def test_checkpoint_loads_through_the_registry(trained) -> None:
    path, metrics = trained
    assert {p.name for p in path.iterdir()} >= {"config.json", "model.safetensors"}
    tok = load_image_tokenizer({"backend": "pairforge-vq", "path_or_id": str(path)})
    assert (tok.codebook_size, tok.downsample, tok.resolution) == (64, 4, 32)
    images = [Image.open(io.BytesIO(b)) for b, _ in zip(
        iter_image_bytes([sample_images_dir()]), range(5), strict=False)]
    grids = tok.encode(images)
    assert all(g.shape == (8, 8) and g.dtype == np.int32 for g in grids)
    decoded = tok.decode(grids)
    assert all(im.size == (32, 32) for im in decoded)
    # same checkpoint, same codes; the fingerprint names weights and preprocessing
    again = load_image_tokenizer({"backend": "pairforge-vq", "path_or_id": str(path)})
    assert all(np.array_equal(a, b) for a, b in zip(grids, again.encode(images), strict=True))
    fp = tok.fingerprint
    assert fp["backend"] == "pairforge-vq" and fp["preprocessing"]["resolution"] == 32
    assert fp["digest"] == again.fingerprint["digest"]
    saved = json.loads((path / "config.json").read_text())
    assert saved["train_metrics"]["psnr"] == pytest.approx(metrics["psnr"])


def test_encode_batches_do_not_change_codes(trained) -> None:
    path, _ = trained
    tok = load_image_tokenizer({"backend": "pairforge-vq", "path_or_id": str(path),
                                "batch_size": 2})
    images = [Image.fromarray(np.full((20, 30, 3), v, np.uint8)) for v in (0, 90, 180, 255)]
    whole = load_image_tokenizer({"backend": "pairforge-vq", "path_or_id": str(path)})
    assert all(np.array_equal(a, b)
               for a, b in zip(tok.encode(images), whole.encode(images), strict=True))
    assert tok.encode([]) == [] and tok.decode([]) == []


def test_quantizer_restarts_dead_codes() -> None:
    torch.manual_seed(0)
    config = vqvae.VQVAEConfig(codebook_size=16, embed_dim=4)
    quantizer = vqvae.EMAQuantizer(config).train()
    z = torch.randn(2, 4, 8, 8)
    quantizer(z)  # initialises the codebook on z
    # move every code far away: none would be chosen again without a restart
    quantizer.embed.add_(100.0)
    quantizer.embed_avg.copy_(quantizer.embed)
    for _ in range(5):
        _, _, indices = quantizer(z)
    assert indices.unique().numel() > 1


def test_train_vq_reads_raw_shards(tmp_path: Path) -> None:
    import webdataset as wds

    shard = tmp_path / "00000.tar"
    with wds.TarWriter(str(shard)) as sink:
        for i, blob in zip(range(6), iter_image_bytes([sample_images_dir()]), strict=False):
            sink.write({"__key__": f"{i:09d}", "jpg": blob, "txt": b"a caption"})
    assert len(list(iter_image_bytes([shard]))) == 6
    metrics = train_vq([shard], tmp_path / "ckpt", resolution=16, codebook_size=8, steps=2,
                       batch_size=4, num_threads=1, log=None)
    assert metrics["train_images"] + metrics["held_out_images"] == 6
    assert vqvae.load(tmp_path / "ckpt").config.resolution == 16


def test_cli_train_vq(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    for path in sorted(sample_images_dir().iterdir())[:6]:
        shutil.copy(path, images / path.name)
    result = CliRunner().invoke(app, ["train-vq", str(images), "--out", str(tmp_path / "ck"),
                                      "--resolution", "16", "--codebook-size", "8",
                                      "--steps", "2", "--batch-size", "4", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "held-out: PSNR" in result.output and "codebook usage" in result.output
    assert (tmp_path / "ck" / "model.safetensors").is_file()


def test_loading_something_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "janus_vqgan"}))
    with pytest.raises(ValueError, match="pairforge-vq"):
        vqvae.load(tmp_path)


@pytest.mark.parametrize("steps", [1, 2, 3, 20, 39])
def test_short_runs_have_a_valid_schedule(steps: int) -> None:
    """OneCycleLR divides by zero when its warm-up rounds to under two steps (20 did)."""
    from pairforge.tokenizers.train_vq import _one_cycle

    optimiser = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = _one_cycle(optimiser, 1e-3, steps)
    rates = []
    for _ in range(steps):
        optimiser.step()
        schedule.step()
        rates.append(optimiser.param_groups[0]["lr"])
    assert all(0 < r <= 1e-3 for r in rates[:-1]) and len(rates) == steps
