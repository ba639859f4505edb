"""Measure a trained run on the scene world: prompt adherence and caption accuracy.

Adherence: the run draws each held-out prompt (the world's exact captions of held-out
scenes, never trained on, written as sentences like cleaned recaptions and alt-text) with
classifier-free guidance; the drawing goes through the
dataset's VQ decoder and the judge reads it back; a drawing adheres when the judged
attributes equal the prompt's (per attribute and all together). Caption accuracy: the run
captions the VQ codes of held-out renders greedily (i2t); a caption is right when it parses
into exactly the scene's attributes. Prompts, scenes and judge come from this package, so
any run trained on scene-world shards is measured the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pairforge.scenes.judge import ATTRIBUTES, compare, judge
from pairforge.scenes.world import Scene, parse_caption, render, scenes

EVAL_SEED = 1234  # the held-out scenes every evaluation uses
# held-out scenes for choosing the guidance scale: other scenes than the measured ones, so
# the reported adherence is not fitted to its own prompts
VALIDATION_SEED = 4321
VALIDATION_PROMPTS = 100
KEYS = (*ATTRIBUTES, "colour+shape", "all")


def load_run(run: str | Path) -> tuple[Any, Any, Any, Any]:
    """(model, layout, text tokenizer, image tokenizer) of a training run folder."""
    from pairforge.tokenizers.registry import load_image_tokenizer, load_text_tokenizer
    from pairforge.train.data import open_datasets
    from pairforge.train.sampling import load_model

    model, layout, cfg = load_model(run)
    datasets = open_datasets(cfg.data)
    tokenize = next(iter(datasets.manifests.values()))["config"]["process"]["tokenize"]
    image = load_image_tokenizer({**tokenize["image"], "device": "cpu"})
    return model, layout, load_text_tokenizer(tokenize["text"]), image


def _mean(rows: list[dict[str, bool]]) -> dict[str, float]:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def adherence(model: Any, layout: Any, text: Any, image: Any, prompts: list[Scene],
              cfg_scale: float = 1.0, temperature: float = 1.0, top_k: int = 0,
              seed: int = 0, batch_size: int = 64) -> dict[str, Any]:
    """Share of drawings whose judged attributes match their prompt."""
    from pairforge.train.sampling import generate_image_codes_batch

    grid = image.grid_shape(image.resolution, image.resolution)
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        codes = generate_image_codes_batch(model, layout, [text.encode(p.sentence) for p in chunk],
                                           grid[0] * grid[1], cfg_scale, temperature, top_k,
                                           generator)
        drawn += image.decode([c.reshape(grid).astype(np.int32) for c in codes])
    judged = [judge(d) for d in drawn]
    rows = [compare(p, j) for p, j in zip(prompts, judged, strict=True)]
    return {"n": len(rows), **_mean(rows), "cfg_scale": cfg_scale, "temperature": temperature,
            "examples": [{"prompt": p.caption, "judged": _describe(j)}
                         for p, j in zip(prompts[:8], judged[:8], strict=True)],
            "images": drawn}


def _describe(s: Scene) -> str:
    return s.caption if len(s.things) in (1, 2) else f"{len(s.things)} objects on " \
        f"a {s.background} background"


def caption_accuracy(model: Any, layout: Any, text: Any, image: Any, truth: list[Scene],
                     batch_size: int = 64) -> dict[str, Any]:
    """Share of greedy i2t captions of held-out renders that state exactly their scene,
    and per attribute (an unparseable caption is wrong on every attribute)."""
    from pairforge.train.sampling import caption_codes_batch

    renders = [render(s, image.resolution) for s in truth]
    codes = image.encode(renders)
    captions: list[str] = []
    for start in range(0, len(codes), batch_size):
        ids = caption_codes_batch(model, layout, codes[start:start + batch_size], max_tokens=48)
        captions += [text.decode(i).strip() for i in ids]
    rows = []
    for caption, s in zip(captions, truth, strict=True):
        parsed = parse_caption(caption)
        rows.append(compare(s.attributes(), parsed) if parsed else dict.fromkeys(KEYS, False))
    return {"n": len(rows), **_mean(rows),
            "parsed": sum(parse_caption(c) is not None for c in captions) / len(captions),
            "examples": [{"truth": s.caption, "caption": c}
                         for s, c in zip(truth[:8], captions[:8], strict=True)]}


def pick_cfg_scale(model: Any, layout: Any, text: Any, image: Any, scales: list[float],
                   temperature: float = 1.0, top_k: int = 0, seed: int = 0,
                   n: int | None = None) -> tuple[float, dict[str, float]]:
    """The guidance scale with the highest all-attribute adherence on validation prompts
    (ties go to the smaller scale), and each scale's validation adherence."""
    prompts = scenes(n or VALIDATION_PROMPTS, "heldout", seed=VALIDATION_SEED)
    tried = {scale: adherence(model, layout, text, image, prompts, scale, temperature, top_k,
                              seed)["all"] for scale in sorted(scales)}
    best = max(tried, key=lambda scale: (tried[scale], -scale))
    return best, tried


def evaluate_run(run: str | Path, prompts: int = 200, captions: int = 200,
                 cfg_scale: float | list[float] = 1.0, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0,
                 sheet: str | Path | None = None) -> dict[str, Any]:
    """Adherence and caption accuracy of a run on the world's held-out scenes.

    Several guidance scales: the one with the best adherence on separate validation
    prompts is used for the measured prompts (the right scale differs between models: a
    sharp model is over-steered by a scale that helps a vague one).
    """
    model, layout, text, image = load_run(run)
    if not image.has_decoder:
        raise ValueError("the run's image tokenizer has no decoder: nothing to judge")
    held = scenes(max(prompts, captions), "heldout", seed=EVAL_SEED)
    scales = cfg_scale if isinstance(cfg_scale, list) else [cfg_scale]
    with torch.no_grad():
        validation: dict[float, float] = {}
        scale = scales[0]
        if len(scales) > 1:
            scale, validation = pick_cfg_scale(model, layout, text, image, scales, temperature,
                                               top_k, seed)
        drawn = adherence(model, layout, text, image, held[:prompts], scale, temperature,
                          top_k, seed)
        said = caption_accuracy(model, layout, text, image, held[:captions])
    drawn["validation_by_scale"] = {str(k): v for k, v in validation.items()}
    images = drawn.pop("images")
    if sheet:
        from pairforge.train.sampling import sheet as make_sheet

        tiles = [(im, f"prompt: {s.caption}") for im, s in zip(images[:16], held, strict=False)]
        make_sheet([tiles[:8], tiles[8:16]]).save(sheet)
    return {"run": str(run), "adherence": drawn, "caption_accuracy": said}


def table(result: dict[str, Any]) -> str:
    """A plain-text table: one row per measure, one column per attribute."""
    head = f"{'':18s}" + "".join(f"{k:>13s}" for k in KEYS)
    rows = [head]
    for name in ("adherence", "caption_accuracy"):
        r = result[name]
        rows.append(f"{name + ' (' + str(r['n']) + ')':18s}"
                    + "".join(f"{r[k]:13.3f}" for k in KEYS))
    drawn = result["adherence"]
    tried = ", ".join(f"{k}: {v:.3f}" for k, v in drawn.get("validation_by_scale", {}).items())
    rows.append(f"guidance scale {drawn['cfg_scale']}"
                + (f" (chosen on {VALIDATION_PROMPTS} validation prompts; all-attribute "
                   f"adherence there {tried})" if tried else ""))
    return "\n".join(rows)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2))
