"""The scene world's captioner: the small BLIP of scenes/blip.py taught the world.

It learns on the ``captioner`` split (scenes the ablation never trains on) and is judged on
the held-out split, whose captions no training split contains: a caption is right when it
parses into exactly the scene's attributes. ``python -m pairforge.scenes.captioner OUT``
trains it (the copy shipped in pairforge/sample/captioner was made so).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from pairforge.scenes.world import Scene, parse_caption, render, scenes

SIDE = 32  # the resolution the demo and the ablation download at


def accuracy(captions: list[str], truth: list[Scene]) -> float:
    """Share of captions that state exactly the scene's attributes."""
    right = sum(parse_caption(c) == t.attributes() for c, t in zip(captions, truth, strict=True))
    return right / len(truth)


def caption_images(folder: str | Path, images: list, batch_size: int = 64,
                   max_new_tokens: int = 24) -> list[str]:
    """Greedy captions through the recaption step's own backend (unconditional BLIP)."""
    from pairforge.config import RecaptionConfig
    from pairforge.recaption.backends import load_captioner

    captioner = load_captioner(RecaptionConfig(enabled=True, model=str(folder),
                                               prompt_mode="none",
                                               max_new_tokens=max_new_tokens))
    out: list[str] = []
    for start in range(0, len(images), batch_size):
        out += captioner.generate(images[start:start + batch_size], "")
    return [c.strip() for c in out]


def _fit(folder: Path, train: list[Scene], steps: int, batch_size: int, lr: float,
         seed: int, log: Any) -> None:
    """AdamW with warmup and cosine decay; images preprocessed once."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).train()
    tok = processor.tokenizer
    pixels = processor(images=[render(s, SIDE) for s in train], return_tensors="pt").pixel_values
    text = tok([f"{tok.bos_token}{s.caption}{tok.eos_token}" for s in train],
               return_tensors="pt", padding=True, add_special_tokens=False)
    labels = text.input_ids.masked_fill(text.attention_mask == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        pick = torch.randint(0, len(train), (batch_size,), generator=generator)
        loss = model(pixel_values=pixels[pick], input_ids=text.input_ids[pick],
                     attention_mask=text.attention_mask[pick], labels=labels[pick]).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if log and (step % 200 == 0 or step == steps - 1):
            log(f"step {step}/{steps} loss {loss.item():.4f}")
    model.eval().save_pretrained(folder)


def train_captioner(out: str | Path, n_train: int = 8000, steps: int = 3000,
                    batch_size: int = 32, lr: float = 2e-3, n_eval: int = 500, seed: int = 0,
                    log: Any = print) -> dict[str, Any]:
    """Build, teach and evaluate the captioner; save it in ``out`` with its report."""
    from pairforge.scenes.blip import save_untrained

    started = time.perf_counter()
    train = scenes(n_train, "captioner")
    folder = save_untrained(out, [s.caption for s in train], resolution=SIDE, seed=seed)
    _fit(folder, train, steps, batch_size, lr, seed, log)
    held = scenes(n_eval, "heldout")
    captions = caption_images(folder, [render(s, SIDE) for s in held])
    report = {"train_scenes": n_train, "split": "captioner", "steps": steps,
              "batch_size": batch_size, "lr": lr, "heldout_scenes": n_eval,
              "heldout_accuracy": accuracy(captions, held),
              "seconds": round(time.perf_counter() - started, 1)}
    (Path(folder) / "scenes_report.json").write_text(json.dumps(report, indent=2))
    if log:
        log(json.dumps(report))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # one thread: a shared machine's cores stall two
    train_captioner(args.out, args.train, args.steps, args.batch_size, args.lr)


if __name__ == "__main__":
    main()
