"""Train our VQ-VAE on a folder of images or on raw shards, report held-out quality, save.

Everything is held in memory as uint8 crops (a few thousand 64-128 px images is a few
tens of MB), so a training step costs only the model. Held-out images are a fixed random
split made before training and never seen by the optimiser; the report on them is what
says whether the tokenizer is usable: reconstruction PSNR, the fraction of codes used and
the perplexity of the code distribution.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from pairforge.machine import usable_cores
from pairforge.tokenizers import vqvae
from pairforge.tokenizers.vq_tokenizer import preprocessing_description, resize_center_crop

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
TAR_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
# training crops are taken from a slightly larger centre square: mild scale/shift augmentation
TRAIN_MARGIN = 1.125


def iter_image_bytes(sources: Iterable[str | Path]) -> Iterable[bytes]:
    """Encoded image bytes from folders (recursive) and webdataset tars, in sorted order."""
    for source in sources:
        path = Path(source)
        if path.is_dir():
            for file in sorted(path.rglob("*")):
                if file.suffix.lower() in IMAGE_SUFFIXES:
                    yield file.read_bytes()
        elif path.suffix == ".tar":
            yield from _tar_images(path)
        else:
            raise ValueError(f"{source}: not a folder of images or a .tar shard")


def _tar_images(path: Path) -> Iterable[bytes]:
    import webdataset as wds

    for sample in wds.WebDataset(str(path), shardshuffle=False, empty_check=False):
        key = next((k for k in TAR_IMAGE_KEYS if k in sample), None)
        if key is not None:
            yield sample[key]


def load_arrays(sources: Iterable[str | Path], side: int, limit: int | None = None) -> np.ndarray:
    """(N, side, side, 3) uint8 centre crops of every decodable image."""
    crops = []
    for blob in iter_image_bytes(sources):
        try:
            image = Image.open(io.BytesIO(blob))
            crops.append(np.asarray(resize_center_crop(image, side)))
        except (OSError, ValueError):
            continue  # a corrupt file should not stop training on the rest
        if limit is not None and len(crops) >= limit:
            break
    if not crops:
        raise ValueError("no decodable images found in the given sources")
    return np.stack(crops)


def to_tensor(batch: np.ndarray) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> float (B, 3, H, W) in [-1, 1]."""
    return torch.from_numpy(batch).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def random_crops(pool: np.ndarray, size: int, batch: int, rng: np.random.Generator) -> torch.Tensor:
    """A batch of random crops with random horizontal flips."""
    picks = rng.integers(0, len(pool), batch)
    max_offset = pool.shape[1] - size
    out = np.empty((batch, size, size, 3), np.uint8)
    for row, index in enumerate(picks):
        y, x = rng.integers(0, max_offset + 1, 2)
        crop = pool[index, y:y + size, x:x + size]
        out[row] = crop[:, ::-1] if rng.random() < 0.5 else crop
    return to_tensor(out)


@torch.no_grad()
def evaluate(model: vqvae.VQVAE, images: np.ndarray, batch_size: int = 64) -> dict[str, float]:
    """Held-out PSNR (dB, on [0, 1] pixels, mean over images), code usage and perplexity."""
    model.eval()
    psnrs, counts = [], torch.zeros(model.config.codebook_size)
    for start in range(0, len(images), batch_size):
        x = to_tensor(images[start:start + batch_size])
        codes = model.encode(x)
        recon = model.decode(codes).clamp(-1, 1)
        mse = ((recon - x) / 2).pow(2).flatten(1).mean(1).clamp_min(1e-10)
        psnrs.append(-10 * torch.log10(mse))
        counts += torch.bincount(codes.flatten(), minlength=counts.numel()).float()
    probs = counts / counts.sum()
    entropy = -(probs[probs > 0] * probs[probs > 0].log()).sum()
    return {"psnr": float(torch.cat(psnrs).mean()),
            "codebook_usage": float((counts > 0).float().mean()),
            "codes_used": int((counts > 0).sum()),
            "perplexity": float(entropy.exp())}


def train_vq(
    sources: str | Path | list[str | Path],
    out_dir: str | Path,
    resolution: int = 64,
    codebook_size: int = 512,
    channels: list[int] | None = None,
    embed_dim: int = 16,
    steps: int = 1000,
    batch_size: int = 16,
    lr: float = 2e-3,
    holdout: float = 0.1,
    seed: int = 0,
    num_threads: int | None = None,
    max_images: int | None = None,
    log: Callable[[str], None] | None = print,
    log_every: int = 100,
) -> dict[str, Any]:
    """Train, evaluate on the held-out split, save to ``out_dir``; return the metrics.

    Defaults reach about 24 dB held-out PSNR on the 399-image COCO sample at 64 px in a few
    minutes on 2 CPU cores (bench/RESULTS_vq.md has the measured figures).
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    source_list = [sources] if isinstance(sources, str | Path) else list(sources)
    train_pool, held_out = _split(source_list, resolution, holdout, rng, max_images)
    config = vqvae.VQVAEConfig(resolution=resolution, codebook_size=codebook_size,
                               channels=channels or [32, 64], embed_dim=embed_dim)
    model = vqvae.VQVAE(config)
    start = time.perf_counter()
    with torch_threads(num_threads):
        before = evaluate(model, held_out)
        _fit(model, train_pool, config, steps, batch_size, lr, rng, log, log_every)
        after = evaluate(model, held_out)
        threads = torch.get_num_threads()
    metrics = {"before": before, **after, "steps": steps,
               "train_images": len(train_pool), "held_out_images": len(held_out),
               "resolution": resolution, "codebook_size": codebook_size,
               "downsample": config.downsample, "seconds": round(time.perf_counter() - start, 1),
               "threads": threads}
    vqvae.save(model, out_dir, extra={"preprocessing": preprocessing_description(resolution),
                                      "train_metrics": metrics})
    if log:
        log(f"held-out: PSNR {metrics['psnr']:.2f} dB, codebook usage "
            f"{metrics['codebook_usage']:.1%} ({metrics['codes_used']}/{codebook_size}), "
            f"perplexity {metrics['perplexity']:.1f}; saved to {out_dir}")
    return metrics


def _split(sources: list[str | Path], resolution: int, holdout: float,
           rng: np.random.Generator, max_images: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(training pool of larger crops, held-out crops at the exact resolution)."""
    big = load_arrays(sources, math.ceil(resolution * TRAIN_MARGIN), max_images)
    if len(big) < 2:
        raise ValueError("need at least two images: one to train on, one held out")
    order = rng.permutation(len(big))
    # at least one held-out image, at least one to train on
    n_held = min(max(1, round(len(big) * holdout)), len(big) - 1)
    held_idx, train_idx = order[:n_held], order[n_held:]
    # held-out images are re-cropped from the source size so they match encode()'s input
    held = load_arrays(sources, resolution, max_images)[held_idx]
    return big[train_idx], held


def _one_cycle(optimiser: torch.optim.Optimizer, lr: float,
               steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """5 % warm-up, then annealing. A warm-up under two steps makes OneCycleLR divide by
    zero, so short runs warm up for two steps; under three steps the rate is constant."""
    if steps < 3:
        return torch.optim.lr_scheduler.LambdaLR(optimiser, lambda _: 1.0)
    return torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=lr, total_steps=steps,
                                               pct_start=max(0.05, 2 / steps))


def _fit(model: vqvae.VQVAE, pool: np.ndarray, config: vqvae.VQVAEConfig, steps: int,
         batch_size: int, lr: float, rng: np.random.Generator,
         log: Callable[[str], None] | None, log_every: int) -> None:
    model.train()
    optimiser = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.99))
    schedule = _one_cycle(optimiser, lr, steps)
    for step in range(1, steps + 1):
        x = random_crops(pool, config.resolution, batch_size, rng)
        recon, commit, _ = model(x)
        recon_loss = F.mse_loss(recon, x)
        loss = recon_loss + config.commitment * commit
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        schedule.step()
        if log and (step % log_every == 0 or step == steps):
            psnr = -10 * math.log10(max(recon_loss.item() / 4, 1e-10))
            log(f"step {step}/{steps}: recon mse {recon_loss.item():.4f} "
                f"(train PSNR {psnr:.1f} dB), commit {commit.item():.4f}")


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` intra-op threads, then restore (training runs inside test processes)."""
    previous = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def default_threads() -> int:
    """All cores this process may use (the CLI trains alone on the machine)."""
    return usable_cores()
