"""Caption -> image with classifier-free guidance, image -> caption greedily, a PNG sheet.

The unconditional branch of CFG is the image prefix right after ``[EOS] [SOV]``: exactly the
context of i2t (and img) training examples, which is why the replacement recipe keeps
that branch alive without caption dropout. Generated codes go through the dataset's VQ
decoder; captions through its text tokenizer.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from pairforge.tokenizers.vocab import VocabLayout
from pairforge.train.config import DataConfig, TrainConfig
from pairforge.train.data import open_datasets, read_samples
from pairforge.train.loop import CHECKPOINT
from pairforge.train.model import Transformer

TILE = 160
TEXT_LINES = 5
LINE_HEIGHT = 12


def load_model(run: str | Path) -> tuple[Transformer, VocabLayout, TrainConfig]:
    """The model of a training run folder (or a checkpoint file), in eval mode on CPU."""
    path = Path(run)
    checkpoint = path / CHECKPOINT if path.is_dir() else path
    if not checkpoint.is_file():
        from pairforge.config import ConfigError

        raise ConfigError(f"{checkpoint} does not exist: give a training run folder (where "
                          f"pairforge train wrote {CHECKPOINT}) or the checkpoint file")
    data = torch.load(checkpoint, map_location="cpu", weights_only=False)
    cfg = TrainConfig.model_validate(data["config"])
    layout = VocabLayout.from_manifest(data["layout"])
    model = Transformer(cfg.model, layout.total_size)
    model.load_state_dict(data["model"])
    return model.eval(), layout, cfg


def _last_logits(model: Transformer, context: list[int]) -> torch.Tensor:
    return model(torch.tensor([context], dtype=torch.int64))[0, -1].float()


@torch.no_grad()
def generate_image_codes(model: Transformer, layout: VocabLayout, caption: list[int],
                         n_tokens: int, cfg_scale: float = 1.0, temperature: float = 1.0,
                         top_k: int = 0, generator: torch.Generator | None = None) -> np.ndarray:
    """n_tokens image codes for a caption: logits = u + s * (c - u), image codes only.
    cond context: [EOS] c [SOV] x_<t; uncond context: [EOS] [SOV] x_<t."""
    cond = [layout.eos, *caption, layout.sov]
    uncond = [layout.eos, layout.sov]
    lo, hi = layout.image_offset, layout.sov
    for _ in range(n_tokens):
        c = _last_logits(model, cond)[lo:hi]
        u = _last_logits(model, uncond)[lo:hi] if cfg_scale != 1.0 else c
        logits = (u + cfg_scale * (c - u)) / max(temperature, 1e-6)
        if top_k:
            kth = torch.topk(logits, min(top_k, len(logits))).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        code = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        cond.append(lo + code)
        uncond.append(lo + code)
    return np.asarray(cond[len(caption) + 2:], dtype=np.int64) - lo


def _top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if not top_k:
        return logits
    kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


class _Cached:
    """Incremental decoding for :class:`Transformer`: each block's keys and values are kept,
    so a new token costs one position instead of the whole context (same arithmetic as
    ``Transformer.forward``; tests compare both)."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(model.blocks)
        self.length = 0

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the last position after appending ``tokens`` (B, t)."""
        m, (b, t) = self.model, tokens.shape
        if self.length + t > m.cfg.max_seq_len:
            raise ValueError(f"sequence of {self.length + t} tokens exceeds model.max_seq_len "
                             f"{m.cfg.max_seq_len}")
        x = m.embed(tokens) + m.pos(torch.arange(self.length, self.length + t))
        first = self.length == 0
        for i, block in enumerate(m.blocks):
            d = x.shape[-1]
            q, k, v = (z.transpose(1, 2) for z in block.qkv(block.norm1(x)).view(
                b, t, 3, block.n_heads, d // block.n_heads).unbind(2))
            if not first:
                k, v = torch.cat([self.kv[i][0], k], 2), torch.cat([self.kv[i][1], v], 2)
            self.kv[i] = (k, v)
            # the prefix attends causally; a later token attends to everything before it
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=first and t > 1)
            x = x + block.proj(attn.transpose(1, 2).reshape(b, t, d))
            x = x + block.mlp(block.norm2(x))
        self.length += t
        return (m.norm(x[:, -1]) @ m.embed.weight.T).float()


@torch.no_grad()
def generate_image_codes_batch(model: Transformer, layout: VocabLayout,
                               captions: list[list[int]], n_tokens: int, cfg_scale: float = 1.0,
                               temperature: float = 1.0, top_k: int = 0,
                               generator: torch.Generator | None = None) -> list[np.ndarray]:
    """:func:`generate_image_codes` for many captions at once, in input order.

    Captions of one token length run as one batch (no padding: positions stay exactly those
    of training), with cached keys and values for both the conditional and the
    unconditional context.
    """
    out: list[np.ndarray | None] = [None] * len(captions)
    by_length: dict[int, list[int]] = {}
    for i, caption in enumerate(captions):
        by_length.setdefault(len(caption), []).append(i)
    lo, hi = layout.image_offset, layout.sov
    for rows in by_length.values():
        cond, uncond = _Cached(model), _Cached(model)
        c = cond(torch.tensor([[layout.eos, *captions[i], layout.sov] for i in rows]))
        u = uncond(torch.tensor([[layout.eos, layout.sov]] * len(rows)))
        drawn = []
        for _ in range(n_tokens):
            c, u = c[:, lo:hi], u[:, lo:hi] if cfg_scale != 1.0 else c[:, lo:hi]
            logits = _top_k((u + cfg_scale * (c - u)) / max(temperature, 1e-6), top_k)
            codes = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator) + lo
            drawn.append(codes)
            if len(drawn) < n_tokens:
                c = cond(codes)
                u = uncond(codes) if cfg_scale != 1.0 else c
        grid = torch.cat(drawn, 1) - lo
        for row, i in enumerate(rows):
            out[i] = grid[row].numpy().astype(np.int64)
    return [o for o in out if o is not None]


@torch.no_grad()
def caption_codes_batch(model: Transformer, layout: VocabLayout, codes: list[np.ndarray],
                        max_tokens: int = 64) -> list[list[int]]:
    """:func:`caption_codes` (greedy, text ids only, until EOS) for images of one size."""
    images = [layout.image_ids(np.asarray(c).reshape(-1)).tolist() for c in codes]
    if len({len(i) for i in images}) > 1:
        raise ValueError("caption_codes_batch needs images with the same number of codes")
    cached = _Cached(model)
    logits = cached(torch.tensor([[layout.eos, layout.sov, *i, layout.eov] for i in images]))
    allowed = torch.full((layout.total_size,), float("-inf"))
    allowed[:layout.text_vocab_size] = 0
    allowed[layout.eos] = 0
    done = torch.zeros(len(images), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in images]
    room = model.cfg.max_seq_len - cached.length
    for step in range(min(max_tokens, room)):
        token = torch.argmax(logits + allowed, -1).masked_fill(done, layout.eos)
        done |= token == layout.eos
        for row in torch.nonzero(~done).flatten().tolist():
            out[row].append(int(token[row]))
        if bool(done.all()) or step == min(max_tokens, room) - 1:
            break
        logits = cached(token[:, None])
    return out


@torch.no_grad()
def caption_codes(model: Transformer, layout: VocabLayout, codes: np.ndarray,
                  max_tokens: int = 64) -> list[int]:
    """Greedy caption after [EOS] [SOV] x [EOV]: text ids only, until EOS."""
    context = [layout.eos, layout.sov, *layout.image_ids(np.asarray(codes).reshape(-1)).tolist(),
               layout.eov]
    allowed = torch.full((layout.total_size,), float("-inf"))
    allowed[:layout.text_vocab_size] = 0
    allowed[layout.eos] = 0
    out: list[int] = []
    room = model.cfg.max_seq_len - len(context)
    for _ in range(min(max_tokens, room)):
        token = int(torch.argmax(_last_logits(model, context) + allowed))
        if token == layout.eos:
            break
        out.append(token)
        context.append(token)
    return out


def _tokenizers(data: DataConfig) -> tuple[Any, Any, list[dict[str, Any]]]:
    """The dataset's text and image tokenizers (from its manifest) and held-out samples."""
    from pairforge.tokenizers.registry import load_image_tokenizer, load_text_tokenizer

    datasets = open_datasets(data)
    manifest = next(iter(datasets.manifests.values()))
    tokenize = manifest["config"]["process"]["tokenize"]
    image = load_image_tokenizer({**tokenize["image"], "device": "cpu"})
    text = load_text_tokenizer(tokenize["text"])
    shards = datasets.heldout or datasets.train
    held = list(read_samples({"url": s.url} for s in shards))
    return text, image, held


def sheet(rows: list[list[tuple[Image.Image, str]]]) -> Image.Image:
    """Rows of (image, text) tiles."""
    columns = max(len(r) for r in rows)
    tile_h = TILE + TEXT_LINES * LINE_HEIGHT + 8
    out = Image.new("RGB", (columns * TILE, len(rows) * tile_h), "white")
    draw = ImageDraw.Draw(out)
    font = ImageFont.load_default()
    for r, row in enumerate(rows):
        for c, (image, text) in enumerate(row):
            x, y = c * TILE, r * tile_h
            out.paste(image.convert("RGB").resize((TILE - 8, TILE - 8), Image.Resampling.NEAREST),
                      (x + 4, y + 4))
            for j, line in enumerate(textwrap.wrap(text, TILE // 6)[:TEXT_LINES]):
                draw.text((x + 4, y + TILE + j * LINE_HEIGHT), line, fill="black", font=font)
    return out


def caption_label(generated: str, reference: str) -> str:
    """The text under a captioned image: an empty generation is said, not shown as
    "model:  |"."""
    said = generated.strip() or "(nothing: no caption tokens generated)"
    return f"model: {said} | ref: {reference}"


def sample_run(run: str | Path, output: str, prompts: list[str] | None = None, n: int = 8,
               cfg_scale: float = 1.0, temperature: float = 1.0, top_k: int = 0,
               seed: int = 0) -> dict[str, Any]:
    """Images for the prompts (default: held-out captions), captions for held-out images;
    writes the PNG sheet and ``output`` with .json holding prompts and captions."""
    model, layout, cfg = load_model(run)
    text, image, held = _tokenizers(cfg.data)
    held = held[:n]
    prompts = prompts or [text.decode(s["caption"].tolist()) for s in held if len(s["caption"])]
    grid = image.grid_shape(image.resolution, image.resolution)
    generator = torch.Generator().manual_seed(seed)
    codes = [generate_image_codes(model, layout, text.encode(p), grid[0] * grid[1], cfg_scale,
                                  temperature, top_k, generator).reshape(grid) for p in prompts]
    drawn = image.decode([c.astype(np.int32) for c in codes])
    captions = [{"key": s["key"], "reference": text.decode(s["caption"].tolist()),
                 "generated": text.decode(caption_codes(model, layout, s["codes"]))}
                for s in held]
    recon = image.decode([np.asarray(s["codes"], np.int32) for s in held])
    rows = [[(im, f"prompt: {p}") for im, p in zip(drawn, prompts, strict=True)],
            [(im, caption_label(c["generated"], c["reference"]))
             for im, c in zip(recon, captions, strict=True)]]
    sheet([r for r in rows if r]).save(output)
    result = {"cfg_scale": cfg_scale, "temperature": temperature, "top_k": top_k, "seed": seed,
              "images": [{"prompt": p, "codes": c.tolist()} for p, c in
                         zip(prompts, codes, strict=True)],
              "captions": captions, "json": str(Path(output).with_suffix(".json"))}
    Path(result["json"]).write_text(json.dumps(result, indent=2))
    return result
