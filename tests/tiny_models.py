"""Tiny random-weight captioners built from transformers configs, for the tests and
bench/recaption.py (which imports this with tests/ on sys.path); the tests' detector is
tiny_detector.py, their VQ models tiny_vq.py.

No model hub is reachable here (DESIGN.md section 8), so tests train a byte-level BPE on
the captions at hand, build a BLIP, GIT or Idefics3 (SmolVLM's architecture, with a chat
template) model a few hundred kB large around it, and save both with ``save_pretrained``:
the recaption step then loads the folder through ``AutoProcessor`` /
``AutoModelForImageTextToText`` exactly as it loads a hub id. The tokenizer and the BLIP
config are the scene world captioner's (pairforge/scenes/blip.py), at 32 wide instead of 64.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pairforge.scenes.blip import blip, token_ids, train_tokenizer

__all__ = ["TINY", "fit_captioner", "save_tiny_captioner", "train_tokenizer"]

Arch = Literal["blip", "git", "idefics3"]
Size = Literal["tiny", "base"]
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _blip(tokenizer, resolution: int, size: Size):  # noqa: ANN001, ANN202
    if size == "tiny":
        return blip(tokenizer, resolution, TINY, initializer_range=None)
    from transformers import (
        BlipConfig,
        BlipForConditionalGeneration,
        BlipImageProcessor,
        BlipProcessor,
    )

    text = dict(vocab_size=len(tokenizer), sep_token_id=tokenizer.eos_token_id,
                **token_ids(tokenizer))
    model = BlipForConditionalGeneration(BlipConfig(text_config=text,
                                                    vision_config={"image_size": resolution}))
    images = BlipImageProcessor(size={"height": resolution, "width": resolution})
    return model, BlipProcessor(image_processor=images, tokenizer=tokenizer)


def _git(tokenizer, resolution: int, size: Size):  # noqa: ANN001, ANN202
    from transformers import CLIPImageProcessor, GitConfig, GitForCausalLM, GitProcessor

    if size == "tiny":
        vision = dict(TINY, image_size=resolution, patch_size=8, projection_dim=32)
        config = GitConfig(vision_config=vision, vocab_size=len(tokenizer),
                           max_position_embeddings=96, **TINY, **token_ids(tokenizer))
    else:  # GIT-base: CLIP ViT-B/16 encoder, 6-layer 768-wide text decoder
        config = GitConfig(vision_config={"image_size": resolution, "patch_size": 16},
                           vocab_size=len(tokenizer), **token_ids(tokenizer))
    images = CLIPImageProcessor(size={"shortest_edge": resolution},
                                crop_size={"height": resolution, "width": resolution})
    return GitForCausalLM(config), GitProcessor(image_processor=images, tokenizer=tokenizer)


# SmolVLM's chat template: "User:<image>PROMPT<end_of_utterance>\nAssistant:"
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def _idefics3(tokenizer, resolution: int, size: Size):  # noqa: ANN001, ANN202
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    if size != "tiny":
        raise ValueError("idefics3: only size=tiny (use a SmolVLM checkpoint for real runs)")
    patch, scale = 16, 2
    images = Idefics3ImageProcessor(size={"longest_edge": resolution}, do_image_splitting=False,
                                    max_image_size={"longest_edge": resolution})
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                  image_seq_len=(resolution // patch // scale) ** 2,
                                  chat_template=IDEFICS3_TEMPLATE)  # adds its image tokens
    tokenizer = processor.tokenizer
    text = dict(TINY, model_type="llama", vocab_size=len(tokenizer), num_key_value_heads=2,
                max_position_embeddings=256, **token_ids(tokenizer))
    vision = dict(TINY, num_hidden_layers=1, image_size=resolution, patch_size=patch)
    model = Idefics3ForConditionalGeneration(Idefics3Config(
        vision_config=vision, text_config=text, scale_factor=scale,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    return model, processor


def save_tiny_captioner(arch: Arch, out_dir: str | Path, captions: Iterable[str],
                        resolution: int = 32, seed: int = 0, size: Size = "tiny") -> Path:
    """A random-weight ``arch`` captioner with a tokenizer trained on ``captions``;
    ``size="base"`` builds the published base architecture (for benchmarks; BLIP and GIT)."""
    import torch

    torch.manual_seed(seed)
    tokenizer = train_tokenizer(captions, vocab_size=8192 if size == "base" else 512)
    build = {"blip": _blip, "git": _git, "idefics3": _idefics3}[arch]
    model, processor = build(tokenizer, resolution, size)
    out = Path(out_dir)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def fit_captioner(folder: str | Path, images: list, captions: list[str], steps: int = 150,
                  lr: float = 3e-3, batch_size: int = 8, seed: int = 0) -> Path:
    """Teach a saved tiny captioner ``captions`` for ``images`` (PIL) by plain supervised
    steps, and save it back: a real model whose generations depend on the image, small
    enough to train in seconds (tests overfit it on a handful of pairs)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tokenizer = processor.tokenizer
    for step in range(steps):
        pick = [(step * batch_size + i) % len(images) for i in range(batch_size)]
        batch = processor(images=[images[i] for i in pick], return_tensors="pt")
        text = tokenizer([f"{tokenizer.bos_token}{captions[i]}{tokenizer.eos_token}"
                          for i in pick], return_tensors="pt", padding=True,
                         add_special_tokens=False)
        labels = text.input_ids.masked_fill(text.attention_mask == 0, -100)
        loss = model(pixel_values=batch.pixel_values, input_ids=text.input_ids,
                     attention_mask=text.attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(folder)
    return Path(folder)


def main() -> None:
    """python tests/tiny_models.py IMAGES_DIR CAPTIONS_CSV OUT [STEPS]: a tiny BLIP at 64 px
    taught a folder's pairs (the offline demo's captioner before the scene world's, which
    ``python -m pairforge.scenes.captioner`` builds into pairforge/sample/captioner)."""
    import csv
    import sys

    from PIL import Image

    images_dir, captions_csv, out = (Path(a) for a in sys.argv[1:4])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 400
    with open(captions_csv, newline="") as f:
        pairs = [(r["filename"], r["caption"]) for r in csv.DictReader(f)]
    captions = [c for _, c in pairs]
    images = [Image.open(images_dir / name).convert("RGB") for name, _ in pairs]
    save_tiny_captioner("blip", out, captions, resolution=64)
    fit_captioner(out, images, captions, steps=steps)


if __name__ == "__main__":
    main()
