"""CLIP image-text similarity with open_clip, as a stage-3 model step.

Models load through open_clip's own functions: a model name plus a pretrained tag
(``ViT-B-32`` / ``laion2b_s34b_b79k``) or a local checkpoint path, and optionally a model
config JSON for architectures open_clip does not ship. The score is the cosine similarity
of the image embedding and a caption's text embedding (no logit scale).

Which caption: in an alt-text-first build the alt-text, which is the training caption, and
the clip step judges it before the costlier steps. In a recaption-first build
(config.recaption_first) the clip step encodes every image early (classifiers, semantic
dedup and the recaption step's grounding read the embeddings) and ``clip.score`` decides
what is judged: ``original``, the usable alt-text, here; ``training`` (the default) or
``both``, the training caption: after recaptioning, ``clip_candidates`` scores each caption
that may train (``clip_score_original``, ``clip_score_recaption``,
``clip_score_recaption_2``; ``both`` adds the alt-text when it cannot train, ``tasks.caption:
best`` ranks them all) from the same image embedding, and after the choice
``clip_training`` judges the chosen one's score.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np
import pyarrow as pa
from PIL import Image

from pairforge.batching import FixedForward
from pairforge.config import ClipConfig, ModelPoolConfig
from pairforge.filters.clip_view import clip_view, split_preprocess
from pairforge.filters.selection import kth_largest
from pairforge.images import ImageView, model_device, model_dtype, view_images
from pairforge.records import Status, process_columns
from pairforge.sources import OpenClipModel
from pairforge.stage import (
    ModelStep,
    Requirements,
    ScoreMap,
    ScoringStep,
    Step,
    StepConfig,
    StepResult,
    setting_values,
)


class ClipScorer:
    """An open_clip model with its preprocessing and tokenizer, scoring (image, text) pairs."""

    def __init__(self, cfg: ClipConfig, device: str = "cpu"):
        import open_clip
        import torch

        if cfg.model_config_path:
            open_clip.add_model_config(cfg.model_config_path)
        self.model, _, self.preprocess = open_clip.create_model_and_transforms(
            cfg.model, pretrained=cfg.pretrained, device=device)
        self.model.eval()
        self.tokenizer = open_clip.get_tokenizer(cfg.model)
        self.device = device
        # one per tower (pairforge/batching.py): an image tower out of memory halves its
        # own calls, not the text tower's
        self.forwards = {"image": FixedForward(cfg.call_rows, "clip image tower"),
                         "text": FixedForward(cfg.call_rows, "clip text tower")}
        self.name = f"{cfg.model}/{cfg.pretrained or 'random-init'}"
        self.view, self.to_tensor = _own_view(cfg, self.preprocess)
        dtype = model_dtype(cfg.dtype, device)  # auto: bf16 on GPUs, fp32 on CPU
        self.autocast = (torch.autocast(device.split(":")[0], dtype)
                         if dtype != torch.float32 else contextlib.nullcontext())
        towers = (self.model.encode_image, self.model.encode_text)
        self.encode_image, self.encode_text = (
            tuple(torch.compile(t) for t in towers) if cfg.compile else towers)

    def _run(self, tower: str, tensor: Any) -> np.ndarray:
        import torch

        fn = self.encode_image if tower == "image" else self.encode_text
        with torch.inference_mode(), self.autocast:
            out = self.forwards[tower](fn, tensor.to(self.device)).float()
            return torch.nn.functional.normalize(out, dim=-1).cpu().numpy()

    def embed_images(self, images: list[Image.Image]) -> np.ndarray:
        import torch

        batch = torch.stack([self.preprocess(im) for im in images])
        return self._run("image", batch)

    def embed_view(self, pictures: list[Image.Image]) -> np.ndarray:
        """Embeddings of pictures already in ``self.view`` (resized and cropped)."""
        import torch

        return self._run("image", torch.stack([self.to_tensor(p) for p in pictures]))

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        return self._run("text", self.tokenizer(texts))

    def score(self, images: list[Image.Image], texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(cosine similarity per pair, normalised image embeddings)."""
        image_emb = self.embed_images(images)
        text_emb = self.embed_texts(texts)
        return (image_emb * text_emb).sum(axis=1), image_emb


def _own_view(cfg: ClipConfig, preprocess: Any) -> tuple[ImageView, Any]:
    """The view the loaded model reads and the rest of its preprocessing. The declared view
    (clip_view.py, what the chain prepares) when it is the same resize and crop; else one
    of its own that the chain never prepares, so the step resizes here, as loaded."""
    own, to_tensor = split_preprocess(preprocess)
    declared = clip_view(cfg)
    if declared and repr(declared[0].prepare.transform) == repr(own):
        return declared[0], to_tensor
    if declared:
        logging.getLogger(__name__).warning(
            "clip: the loaded preprocessing %r differs from the one built from the config %r;"
            " this actor resizes its own pictures", own, declared[0].prepare.transform)
    return ImageView(f"own:{cfg.model}:{own!r}", own), to_tensor


def clip_embed_dim(cfg: ClipConfig) -> int | None:
    """The image embedding size of the configured open_clip model, from its config alone
    (no weights loaded); None when open_clip does not know the model (an hf-hub: id)."""
    import open_clip

    if cfg.model_config_path:
        open_clip.add_model_config(cfg.model_config_path)
    config = open_clip.get_model_config(cfg.model)
    return int(config["embed_dim"]) if config and "embed_dim" in config else None


def clip_source(cfg: StepConfig) -> OpenClipModel:
    """The clip section's model, as the clip step, grounding and the caption cache load it."""
    clip = cfg.process.clip
    return OpenClipModel("process.clip", clip.model, clip.pretrained, clip.model_config_path)


def read_by_heads(cfg: StepConfig) -> bool:
    """Whether a classifier reads the clip step's image embedding (a clip-head does)."""
    return any(c.backend == "clip-head" for c in cfg.process.classifiers)


def _cached(rows: pa.Table, column: str) -> list:
    """A column the scoring pass cached (pipeline/stream.load_rows), else all None."""
    return rows[column].to_pylist() if column in rows.column_names else [None] * rows.num_rows


class ClipStep(ScoringStep, ModelStep):
    """Scores ok rows that have no score yet; filters by the configured threshold.

    In ``top_fraction`` mode the threshold is learned first, in a scoring pass over every
    shard (scores cached per shard in ``OUT/clip``): the writing pass then runs in
    ``threshold`` mode with it, reading the cached scores instead of scoring again."""

    name = "clip"
    requires = ("image", "caption", "caption_issue")
    provides = process_columns("clip_score", "clip_embedding")
    ends = (Status.LOW_CLIP_SCORE,)
    score_column = "clip_score"
    embedding_column = "clip_embedding"

    @classmethod
    def pool_config(cls, cfg: StepConfig) -> ModelPoolConfig:
        return cfg.process.clip

    @classmethod
    def enabled(cls, cfg: StepConfig) -> bool:
        return cfg.process.clip.enabled

    @classmethod
    def requirements(cls, cfg: StepConfig) -> Requirements:
        return Requirements(display=cfg.process.clip.model, sources=(clip_source(cfg),),
                            settings=setting_values(cfg.process.clip, "process.clip."))

    @classmethod
    def image_views(cls, cfg: StepConfig) -> tuple[ImageView, ...]:
        return clip_view(cfg.process.clip)

    @classmethod
    def stage_stats(cls, cfg: StepConfig) -> dict[str, Any]:
        clip = cfg.process.clip
        stats: dict[str, Any] = {"clip_model": f"{clip.model}/{clip.pretrained}"}
        if clip.mode == "threshold":
            stats["clip_threshold"] = clip.threshold
        return stats

    @classmethod
    def manifest_entries(cls, cfg: StepConfig, first: dict[str, Any],
                         totals: dict[str, Any]) -> dict[str, Any]:
        # the model and threshold the shards were made with (the same in every shard)
        return {"models": {"clip": first.get("clip_model"),
                           "clip_threshold": first.get("clip_threshold")}}

    # -- the scoring pass -----------------------------------------------------------------

    @classmethod
    def needs_scoring_pass(cls, cfg: StepConfig) -> bool:
        return cfg.process.clip.mode == "top_fraction"

    @classmethod
    def scoring_config(cls, cfg: StepConfig, for_embeddings: bool) -> StepConfig:
        scoring = cfg.with_process(cfg.process.model_copy(deep=True))
        scoring.process.clip.mode = "score_only"
        if for_embeddings:
            scoring.process.clip.save_embeddings = True
            return scoring
        # semantic dedup reads the embeddings of this pass (pipeline/semantic_stage.py), and
        # clip-head classifiers read them in the writing pass (pipeline/stream.py), so no
        # image is encoded twice
        scoring.process.clip.save_embeddings |= (cfg.semantic_dedup
                                                 or read_by_heads(cfg))
        scoring.process.classifiers = []  # they run in the writing pass
        return scoring

    @classmethod
    def learn(cls, cfg: StepConfig, over_scores: ScoreMap
              ) -> tuple[StepConfig, dict[str, Any]]:
        """``top_fraction`` mode: the threshold is the k-th largest score of the stage,
        selected exactly in two passes of histograms (filters/selection.py)."""
        top_fraction = cfg.process.clip.top_fraction
        resolved = cfg.with_process(cfg.process.model_copy(deep=True))
        resolved.process.clip.mode = "threshold"
        resolved.process.clip.threshold = kth_largest(over_scores, top_fraction)
        return resolved, {"clip_threshold": resolved.process.clip.threshold,
                          "clip_top_fraction": top_fraction}

    @classmethod
    def score_cut(cls, cfg: StepConfig) -> float | None:
        # in a recaption-first build judging the training caption, this step scores no
        # caption (clip_training judges later): no row is known to be dropped yet
        clip = cfg.process.clip
        judges_here = not cfg.process.recaption_first() or clip.score == "original"
        return clip.threshold if clip.mode == "threshold" and judges_here else None

    @classmethod
    def saves_embeddings(cls, cfg: StepConfig) -> bool:
        """Only when asked and no scoring pass wrote them: its rows are fewer (semantic
        duplicates skip CLIP), and rewriting the scoring pass's files would change what a
        rerun's semantic pass reads."""
        clip = cfg.process.clip
        scoring_pass = clip.enabled and (clip.mode == "top_fraction"
                                         or cfg.semantic_dedup)
        return clip.save_embeddings and not scoring_pass

    def __init__(self, cfg: StepConfig) -> None:
        super().__init__(cfg)
        self.clip_cfg = cfg.process.clip
        self.scorer = ClipScorer(self.clip_cfg, model_device(self.clip_cfg))
        self.for_heads = read_by_heads(cfg)
        self.recaption_first = cfg.process.recaption_first()
        # else clip_training judges the training caption, later, from this embedding
        self.judges = not self.recaption_first or self.clip_cfg.score == "original"
        rc = cfg.process.recaption
        # clip grounding reads the image vector this step made for the caption's row: the
        # recaption step then encodes no image with CLIP again (issue 48)
        self.keeps_for_later = self.recaption_first or (
            rc.enabled and rc.grounding.enabled and rc.grounding.backend == "clip")

    def _texts(self, rows: pa.Table) -> list[str | None]:
        """The caption scored here per row: the alt-text (recaption-first: a usable one)."""
        if not self.judges:
            return [None] * rows.num_rows
        captions = rows["caption"].to_pylist()
        if not self.recaption_first:
            return captions
        return [c if issue is None else None
                for c, issue in zip(captions, rows["caption_issue"].to_pylist(), strict=True)]

    def process(self, rows: pa.Table) -> StepResult:
        captions = self._texts(rows)
        cached = _cached(rows, "clip_score")
        todo = [i for i, (c, s) in enumerate(zip(captions, cached, strict=True))
                if c is not None and s is None]
        # clip-head classifiers read every row's image embedding (also rows without a
        # caption), so they never encode an image again; the scoring pass's are reused
        keep = self.clip_cfg.save_embeddings or self.for_heads or self.keeps_for_later
        embeddings: list[list[float] | None] = (_cached(rows, "clip_embedding") if keep
                                                else [None] * rows.num_rows)
        scored_now = set(todo)
        every = self.for_heads or self.recaption_first
        want = range(rows.num_rows) if every else todo
        encode = [i for i in want if i in scored_now or embeddings[i] is None]
        scores: list[float | None] = list(cached)
        if encode:
            image_emb = self.scorer.embed_view(view_images(rows.take(encode), self.scorer.view))
            at = {i: j for j, i in enumerate(encode)}
            if todo:
                text_emb = self.scorer.embed_texts([captions[i] for i in todo])
                sims = (image_emb[[at[i] for i in todo]] * text_emb).sum(axis=1)
                for j, i in enumerate(todo):
                    scores[i] = float(sims[j])
            if keep:
                for i in encode:
                    embeddings[i] = image_emb[at[i]].tolist()
        return StepResult(columns={"clip_score": scores, "clip_embedding": embeddings},
                          **(clip_decisions(self.clip_cfg, scores) if self.judges else {}))


def clip_decisions(clip: ClipConfig, scores: list[float | None]) -> dict[str, list]:
    """In threshold mode, the rows whose score is below it end ``low_clip_score``."""
    if clip.mode != "threshold":
        return {}
    low = [s is not None and s < clip.threshold for s in scores]
    return {"status": [Status.LOW_CLIP_SCORE.value if x else None for x in low],
            "error": [f"clip_score {s:.4f} < {clip.threshold}" if x else None
                      for s, x in zip(scores, low, strict=True)]}


CANDIDATES = ("recaption", "recaption_2", "original")  # caption_source values, tie order


def scored_candidates(cfg: StepConfig) -> tuple[str, ...]:
    """The candidate captions clip_candidates scores: those that may train under
    ``tasks.caption`` (best: every one), and the alt-text with ``clip.score: both``."""
    choice = cfg.process.training_caption()
    sources = {"recaption": ("recaption",), "mix": ("recaption", "original"),
               "best": CANDIDATES}.get(choice, ())
    if cfg.process.clip.score == "both":
        sources = (*sources, "original")
    return tuple(s for s in CANDIDATES if s in sources)


class ClipCandidatesStep(ModelStep):
    """Recaption-first builds: CLIP's score of each candidate caption of an image (the
    usable alt-text, the recaption, the second prompt's), from the clip step's image
    embedding (encoded here only where none came), before the training caption is chosen."""

    name = "clip_candidates"
    requires = ("image", "caption", "caption_issue")
    provides = process_columns("clip_score_original", "clip_score_recaption",
                               "clip_score_recaption_2")

    @classmethod
    def pool_config(cls, cfg: StepConfig) -> ModelPoolConfig:
        return cfg.process.clip

    @classmethod
    def enabled(cls, cfg: StepConfig) -> bool:
        return (cfg.process.clip.enabled and cfg.process.recaption_first()
                and bool(scored_candidates(cfg)) and (cfg.process.clip.score != "original"
                                                      or cfg.process.training_caption() == "best"))

    @classmethod
    def requirements(cls, cfg: StepConfig) -> Requirements:
        # the clip step records the section's settings and its model; this adds none
        return Requirements(display=cfg.process.clip.model)

    @classmethod
    def image_views(cls, cfg: StepConfig) -> tuple[ImageView, ...]:
        # encodes only the images the clip step left without a vector
        return clip_view(cfg.process.clip)

    def __init__(self, cfg: StepConfig) -> None:
        super().__init__(cfg)
        self.clip_cfg = cfg.process.clip
        self.scorer = ClipScorer(self.clip_cfg, model_device(self.clip_cfg))
        self.sources = scored_candidates(cfg)

    def _texts(self, rows: pa.Table, source: str) -> list[str | None]:
        if source == "original":
            return [c if issue is None else None for c, issue in zip(
                rows["caption"].to_pylist(), rows["caption_issue"].to_pylist(), strict=True)]
        return _cached(rows, source)

    def process(self, rows: pa.Table) -> StepResult:
        texts = {source: self._texts(rows, source) for source in self.sources}
        wanted = [i for i in range(rows.num_rows) if any(t[i] for t in texts.values())]
        image_emb = dict(zip(wanted, self._image_embeddings(rows, wanted), strict=True))
        columns = {}
        for source, captions in texts.items():
            todo = [i for i in wanted if captions[i] is not None]
            scores: list[float | None] = [None] * rows.num_rows
            if todo:
                text_emb = self.scorer.embed_texts([captions[i] for i in todo])
                for i, vector in zip(todo, text_emb, strict=True):
                    scores[i] = float(np.dot(image_emb[i], vector))
            columns[f"clip_score_{source}"] = scores
        return StepResult(columns=columns)

    def _image_embeddings(self, rows: pa.Table, todo: list[int]) -> list[np.ndarray]:
        kept = _cached(rows, "clip_embedding")
        missing = [i for i in todo if kept[i] is None]
        if missing:
            pictures = view_images(rows.take(missing), self.scorer.view)
            for i, vector in zip(missing, self.scorer.embed_view(pictures), strict=True):
                kept[i] = vector
        return [np.asarray(kept[i], dtype=np.float32) for i in todo]


class ClipTrainingStep(Step):
    """Recaption-first builds with ``clip.score`` training or both: once the training
    caption is chosen, its score (clip_candidates') is ``clip_score``, judged here."""

    name = "clip_training"
    requires = ("caption_source",)
    provides = process_columns("clip_score")
    ends = (Status.LOW_CLIP_SCORE,)

    @classmethod
    def enabled(cls, cfg: StepConfig) -> bool:
        clip = cfg.process.clip
        return clip.enabled and cfg.process.recaption_first() and clip.score != "original"

    def process(self, rows: pa.Table) -> StepResult:
        by_source = {s: _cached(rows, f"clip_score_{s}") for s in CANDIDATES}
        scores = [None if source is None else by_source[source][i]
                  for i, source in enumerate(rows["caption_source"].to_pylist())]
        return StepResult(columns={"clip_score": scores},
                          **clip_decisions(self.cfg.process.clip, scores))
