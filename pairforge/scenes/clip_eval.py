"""How well a CLIP knows the scene world, on held-out scenes (captions no training split
holds), loaded through the clip step's own path (filters/clip.py ClipScorer).

* retrieval: each image against the distinct exact captions of the batch, top-1 / top-5;
* per corruption kind of the alt-text model (scenes/corrupt.py: one attribute changed,
  another scene's caption, web junk), the ROC AUC of the score of a scene's exact caption
  against the corrupted ones' (pooled over scenes: what a single threshold separates) and
  the share of scenes whose exact caption scores above its corruption (paired);
* grounding: the cosine of "a photo of a SHAPE" for shapes a scene shows against those it
  does not (the grounding step's question), as an AUC;
* the exact captions' score quantiles, from which the demo's threshold is read.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from pairforge.scenes.clip_files import NOUN_PROMPT, SIDE, register
from pairforge.scenes.corrupt import change_attributes, junk_caption
from pairforge.scenes.world import SHAPES, Scene, render, scenes

EVAL_START = 2000  # held-out scenes past the bundled sample's 1,000


def roc_auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(a positive scores above a negative), ties half (Mann-Whitney U / n1 n2)."""
    both = np.concatenate([positive, negative])
    order = both.argsort(kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    for value in np.unique(both):  # average ranks of ties
        tied = both == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    u = ranks[:len(positive)].sum() - len(positive) * (len(positive) + 1) / 2
    return float(u / (len(positive) * len(negative)))


def corruptions(held: list[Scene], seed: int = 0) -> dict[str, list[str]]:
    """One caption per scene and kind, made by the alt-text model's own functions."""
    rng = random.Random(f"pairforge-clip-eval:{seed}")
    other = []
    for i, s in enumerate(held):
        j = (i + 1 + rng.randrange(len(held) - 1)) % len(held)
        while held[j].caption == s.caption:
            j = (j + 1) % len(held)
        other.append(held[j].sentence)
    return {"exact": [s.sentence for s in held],
            "attribute": [change_attributes(s, rng).sentence for s in held],
            "other_scene": other,
            "junk": [junk_caption(rng) for _ in held]}


def retrieval(image: np.ndarray, captions: list[str], text_of: dict[str, np.ndarray]
              ) -> dict[str, float]:
    unique = sorted(set(captions))
    sims = image @ np.stack([text_of[c] for c in unique]).T
    own = np.array([unique.index(c) for c in captions])
    rank = (sims > sims[np.arange(len(captions)), own][:, None]).sum(axis=1)
    return {"i2t_top1": float((rank < 1).mean()), "i2t_top5": float((rank < 5).mean()),
            "i2t_candidates": len(unique)}


def grounding(scorer: Any, image: np.ndarray, held: list[Scene]) -> dict[str, float]:
    nouns = scorer.embed_texts([NOUN_PROMPT.format(s) for s in SHAPES])
    sims = image @ nouns.T
    present = np.array([[any(t.shape == shape for t in s.things) for shape in SHAPES]
                        for s in held])
    return {"grounding_auc": roc_auc(sims[present], sims[~present]),
            "grounding_present_p05": float(np.quantile(sims[present], 0.05)),
            "grounding_absent_p95": float(np.quantile(sims[~present], 0.95))}


def evaluate(folder: str | Path, n_eval: int = 500, seed: int = 0) -> dict[str, Any]:
    """The figures above for the model saved in ``folder`` (scenes/clip.py's layout)."""
    from pairforge.config import ClipConfig
    from pairforge.filters.clip import ClipScorer

    scorer = ClipScorer(ClipConfig(enabled=True, batch_size=64, **register(folder)))
    held = scenes(n_eval, "heldout", start=EVAL_START)
    image = scorer.embed_images([render(s, SIDE) for s in held])
    kinds = corruptions(held, seed)
    texts = sorted({t for captions in kinds.values() for t in captions})
    text_of = dict(zip(texts, scorer.embed_texts(texts), strict=True))
    score = {kind: (image * np.stack([text_of[t] for t in captions])).sum(axis=1)
             for kind, captions in kinds.items()}
    exact = score["exact"]
    report: dict[str, Any] = {"heldout_scenes": n_eval, "heldout_start": EVAL_START,
                              **retrieval(image, kinds["exact"], text_of)}
    for kind in ("attribute", "other_scene", "junk"):
        report[f"auc_{kind}"] = roc_auc(exact, score[kind])
        report[f"paired_{kind}"] = float((exact > score[kind]).mean())
        report[f"mean_score_{kind}"] = float(score[kind].mean())
    report["mean_score_exact"] = float(exact.mean())
    for q in (0.02, 0.05, 0.1):
        report[f"exact_score_p{round(q * 100):02d}"] = float(np.quantile(exact, q))
    return {**report, **grounding(scorer, image, held)}
