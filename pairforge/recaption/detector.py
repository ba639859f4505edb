"""Grounding by an open-vocabulary object detector: OWL-ViT or OWLv2 queried with nouns.

Each image is asked for the object nouns of its caption, one text query per noun ("a photo
of a NOUN"); a noun's score is its best box's score (the sigmoid of the box's logit for
that query, as OWL-ViT's own post-processing scores boxes), and below ``min_score`` the
image does not support the noun. A detector looks for the object anywhere in the image,
box by box, where CLIP compares one embedding of the whole image with the noun: a small
object in a busy photo is what the detector finds and CLIP misses.

Images of one batch are sent together, each with its own queries; the processor pads the
shorter query lists with blank queries, whose scores are never read. Images without
nouns are not sent at all.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from pairforge.config import DetectorConfig
from pairforge.images import model_dtype
from pairforge.recaption.grounding import Grounding, NounLexicon

# model_type values whose outputs this module reads (logits per box and query)
OWL_TYPES = ("owlvit", "owlv2")


class DetectorGrounding(Grounding):
    """An ``AutoModelForZeroShotObjectDetection`` OWL-ViT/OWLv2 checkpoint with its
    processor, by hub id or local folder."""

    def __init__(self, cfg: DetectorConfig, lexicon: NounLexicon, device: str = "cpu") -> None:
        from transformers import AutoModelForZeroShotObjectDetection, AutoProcessor

        super().__init__(lexicon, cfg.min_score)
        self.cfg, self.device = cfg, device
        self.processor = AutoProcessor.from_pretrained(cfg.model, revision=cfg.revision)
        dtype = model_dtype(cfg.dtype, device)
        self.model = AutoModelForZeroShotObjectDetection.from_pretrained(
            cfg.model, revision=cfg.revision, dtype=dtype).to(device).eval()
        model_type = getattr(self.model.config, "model_type", None)
        if model_type not in OWL_TYPES:
            raise ValueError(f"grounding.detector.model {cfg.model} is a {model_type} model; "
                             f"the detector backend reads {' or '.join(OWL_TYPES)} outputs")

    def scores(self, images: list[Image.Image], nouns: list[list[str]],
               embeddings: list[Any]) -> list[list[float]]:
        asked = [i for i, names in enumerate(nouns) if names]
        result: list[list[float]] = [[] for _ in images]
        if not asked:
            return result
        best = self._best_box_scores([images[i] for i in asked], [nouns[i] for i in asked])
        for i, values in zip(asked, best, strict=True):
            result[i] = values
        return result

    def _best_box_scores(self, images: list[Image.Image],
                         nouns: list[list[str]]) -> list[list[float]]:
        import torch

        queries = [[self.cfg.query.format(noun=n) for n in names] for names in nouns]
        inputs = self.processor(text=queries, images=images, return_tensors="pt",
                                truncation=True).to(self.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        with torch.inference_mode():
            logits = self.model(**inputs).logits  # (images, boxes, padded queries)
        best = torch.sigmoid(logits.float()).amax(dim=1).cpu()
        return [best[row, :len(names)].tolist() for row, names in enumerate(nouns)]
