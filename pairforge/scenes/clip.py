"""The scene world's CLIP: a tiny open_clip (ViT at 32 px + a small text transformer) taught
the world contrastively, so the demo's CLIP filter, grounding, semantic dedup and clip-head
classifier read a model that knows what the pictures show.

It learns on the ``captioner`` split (world renders with their exact captions, written as
sentences like every caption source of the pipeline) with open_clip's ClipLoss (InfoNCE over
the batch), plus two terms the in-batch negatives alone teach poorly: each image against
captions with one attribute changed (hard negatives, as NegCLIP) and against concept
prompts: the grounding step's noun prompts ("a photo of a circle": shapes shown positive)
and "a photo with a watermark" (a seeded 10 % of the pictures stamped, their captions
unchanged: the demo's watermark head reads this embedding, scenes/watermark.py). It is judged
on held-out scenes by clip_eval.py. ``python -m pairforge.scenes.clip OUT`` trains it (the
copy shipped in pairforge/sample/clip was made so) and writes ``scenes_report.json``.

The checkpoint is stored in float16 (open_clip's loader copies it into float32 weights):
half the bytes of a token embedding that the default tokenizer's 49,408-word vocabulary
makes most of the model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from pairforge.scenes.clip_files import CHECKPOINT, MODEL_NAME, NOUN_PROMPT, SHIPPED, SIDE, register
from pairforge.scenes.corrupt import change_attributes
from pairforge.scenes.world import SHAPES, Scene, render, scenes

# a concept the captions never state: without it the embedding learns to ignore the stamp,
# and no head over it can find one (scenes/watermark.py)
WATERMARK_PROMPT = "a photo with a watermark"

# a tiny ViT (4-px patches: a small shape spans two) and a narrow text tower: the token
# embedding (vocab x text width) is most of the file, so the text width stays small
MODEL_CONFIG: dict[str, Any] = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": SIDE, "patch_size": 4, "width": 48, "layers": 2,
                   "head_width": 16, "mlp_ratio": 2.0},
    "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 32, "heads": 2,
                 "layers": 2, "mlp_ratio": 2.0},
}


def create(folder: Path, seed: int) -> tuple[Any, Any, Any]:
    """A seeded untrained model (with its preprocessing and tokenizer), its config written."""
    import open_clip
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{MODEL_NAME}.json").write_text(json.dumps(MODEL_CONFIG, indent=2) + "\n")
    register(folder)
    torch.manual_seed(seed)
    model, _, preprocess = open_clip.create_model_and_transforms(MODEL_NAME)
    return model, preprocess, open_clip.get_tokenizer(MODEL_NAME)


def hard_negatives(batch: list[Scene], rng: random.Random, k: int) -> list[str]:
    """``k`` captions per scene with one attribute changed (the alt-text corruption)."""
    return [change_attributes(s, rng).sentence for s in batch for _ in range(k)]


def _losses(model: Any, clip_loss: Any, pixels: Any, tokens: Any, negatives: Any,
            nouns: Any, present: Any, k: int) -> tuple[Any, Any, Any]:
    """ClipLoss over the batch; cross-entropy of each image's own caption against its
    ``k`` attribute changes; sigmoid loss of each image against the concept prompts (the
    shapes' nouns, the watermark)."""
    import torch
    import torch.nn.functional as F

    image = model.encode_image(pixels, normalize=True)
    text = model.encode_text(tokens, normalize=True)
    scale = model.logit_scale.exp()
    contrastive = clip_loss(image, text, scale)
    n = image.shape[0]
    hard = model.encode_text(negatives, normalize=True).view(n, k, -1)
    own = (image * text).sum(-1, keepdim=True)
    changed = torch.einsum("nd,nkd->nk", image, hard)
    target = torch.zeros(n, dtype=torch.long, device=image.device)
    attribute = F.cross_entropy(scale * torch.cat([own, changed], dim=1), target)
    noun_text = model.encode_text(nouns, normalize=True)
    # a fixed affine map: present concepts pushed above a cosine of 0.25, absent below
    grounding = F.binary_cross_entropy_with_logits(10 * (image @ noun_text.T - 0.25), present)
    return contrastive, attribute, grounding


def _schedule(optimizer: Any, steps: int) -> Any:
    import torch

    warm = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))


def _data(train: list[Scene], preprocess: Any, tokenizer: Any, stamped: float
          ) -> tuple[Any, Any, Any, Any]:
    """Pixels and tokens of the training scenes (made once; a seeded ``stamped`` share of
    the pictures carry the stock watermark, their captions unchanged, as on the web), the
    concept prompts' tokens and which concepts each picture shows."""
    import torch

    from pairforge.scenes.watermark import stamp

    marked = set(random.Random("pairforge-scenes-clip-stamps").sample(
        range(len(train)), round(stamped * len(train))))
    pictures = [render(s, SIDE) for s in train]
    pictures = [stamp(p, seed=i) if i in marked else p for i, p in enumerate(pictures)]
    pixels = torch.stack([preprocess(p) for p in pictures])
    tokens = tokenizer([s.sentence for s in train])
    concepts = tokenizer([NOUN_PROMPT.format(shape) for shape in SHAPES] + [WATERMARK_PROMPT])
    present = torch.tensor([[float(any(t.shape == shape for t in s.things)) for shape in SHAPES]
                            + [float(i in marked)] for i, s in enumerate(train)])
    return pixels, tokens, concepts, present


def fit(model: Any, tokenizer: Any, data: tuple, train: list[Scene], steps: int,
        batch_size: int, lr: float, k: int, seed: int, log: Any) -> None:
    """AdamW with warmup and cosine decay over seeded random batches."""
    import torch
    from open_clip.loss import ClipLoss

    pixels, tokens, nouns, present = data
    clip_loss = ClipLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    schedule = _schedule(optimizer, steps)
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(f"pairforge-scenes-clip:{seed}")
    model.train()
    for step in range(steps):
        pick = torch.randperm(len(train), generator=generator)[:batch_size]
        negatives = tokenizer(hard_negatives([train[i] for i in pick.tolist()], rng, k))
        losses = _losses(model, clip_loss, pixels[pick], tokens[pick], negatives, nouns,
                         present[pick], k)
        loss = losses[0] + losses[1] + 2 * losses[2]  # the concepts: few prompts, weak pull
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():  # CLIP's clamp: the temperature never below 1/100
            model.logit_scale.clamp_(0, math.log(100))
        if log and (step % 100 == 0 or step == steps - 1):
            log(f"step {step}/{steps} " + " ".join(
                f"{name} {v.item():.3f}" for name, v in
                zip(("clip", "attribute", "concepts"), losses, strict=True)))
    model.eval()


def save(model: Any, folder: Path) -> Path:
    """The weights as float16 safetensors (loaded back into float32 by open_clip)."""
    from safetensors.torch import save_file

    state = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / CHECKPOINT))
    return folder / CHECKPOINT


def train_clip(out: str | Path, n_train: int = 12000, steps: int = 600,
               batch_size: int = 128, lr: float = 2e-3, negatives: int = 2,
               stamped: float = 0.1, n_eval: int = 500, seed: int = 0,
               log: Any = print) -> dict[str, Any]:
    """Build, teach and evaluate the world CLIP; save it in ``out`` with its report."""
    from pairforge.scenes.clip_eval import evaluate

    started = time.perf_counter()
    folder = Path(out)
    train = scenes(n_train, "captioner")
    model, preprocess, tokenizer = create(folder, seed)
    data = _data(train, preprocess, tokenizer, stamped)
    fit(model, tokenizer, data, train, steps, batch_size, lr, negatives, seed, log)
    save(model, folder)
    trained = round(time.perf_counter() - started, 1)
    report = {"model": MODEL_NAME, "config": MODEL_CONFIG, "train_scenes": n_train,
              "split": "captioner", "steps": steps, "batch_size": batch_size, "lr": lr,
              "hard_negatives_per_image": negatives, "stamped_share": stamped, "seed": seed,
              "train_seconds": trained, "checkpoint_bytes": (folder / CHECKPOINT).stat().st_size,
              **evaluate(folder, n_eval)}
    (folder / "scenes_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if log:
        log(json.dumps(report))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=SHIPPED)
    parser.add_argument("--train", type=int, default=12000)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--negatives", type=int, default=2,
                        help="attribute-changed captions per image and step")
    parser.add_argument("--stamped", type=float, default=0.1,
                        help="share of training pictures carrying the watermark")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # one thread: a shared machine's cores stall two
    train_clip(args.out, args.train, args.steps, args.batch_size, args.lr, args.negatives,
               args.stamped, seed=args.seed)


if __name__ == "__main__":
    main()
