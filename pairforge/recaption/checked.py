"""Captions made safe: generate, clean, filter attributes, ground, retry once, or abstain.

The recaption step (recaption/step.py) wraps this with the cache and the build's claims;
``pairforge recaption-eval`` (recaption/evaluate.py) runs the same code on a table of
reference captions, so what the evaluation measures is what a build writes.

Several threads may caption at once (the recaption step's actor works on several
batches): a server's requests overlap, while model calls (a transformers captioner, CLIP
or the detector for grounding) and the models' loading take one lock, so a GPU never holds
two batches' activations and a model is loaded once. A transformers captioner's rows go
through one queue (recaption/rounds.py): a batch's strict retries are generated in the
same calls as other rows, not in a short pass of their own. A row whose request failed
after the client's retries ends as ``failed:REASON`` (no caption, no strict retry: the
server failed, not the caption).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from PIL import Image

from pairforge.config import ClipConfig, GroundingConfig, RecaptionConfig
from pairforge.filters.clip import ClipScorer
from pairforge.recaption.attributes import load_lexicon, neutralize
from pairforge.recaption.backends import Captioner, load_captioner
from pairforge.recaption.cache import CachedCaption
from pairforge.recaption.detector import DetectorGrounding
from pairforge.recaption.grounding import ClipGrounding, Grounding, NounLexicon
from pairforge.recaption.openai_client import Answer, Failure
from pairforge.recaption.prompts import DEFAULT_PROMPT, STRICT_PROMPT, clean_caption
from pairforge.recaption.rounds import SharedGenerate

Checked = tuple[str, list[str], list[str]]  # caption, attribute flags, problems
FAILED = "failed:"  # a problem (and the row's flag) when the backend gave no answer


def failed(entry: CachedCaption) -> bool:
    """Whether the backend failed to answer for this caption (a server's error)."""
    return any(f.startswith(FAILED) for f in entry.flags)


def _failures(problems: list[str]) -> tuple[str, ...]:
    return tuple(p for p in problems if p.startswith(FAILED))


def _verdict(first: Checked, second: Checked | None) -> CachedCaption:
    """The caption to keep from a first try and, when it had problems, the strict retry."""
    caption, flags, problems = first
    if not problems:
        return CachedCaption(caption, tuple(flags))
    if _failures(problems):
        return CachedCaption(None, _failures(problems))
    assert second is not None
    tried = tuple(f"regenerated:{p}" for p in problems)
    caption, flags, again = second
    if _failures(again):
        return CachedCaption(None, tried + _failures(again))
    if again:
        return CachedCaption(None, tried + tuple(f"abstained:{p}" for p in again))
    return CachedCaption(caption, tried + tuple(flags))


class CheckedCaptioner:
    """The configured captioning backend with the safety checks; the models load on first
    use (a build whose captions all come from the cache loads none)."""

    def __init__(self, recaption: RecaptionConfig, clip: ClipConfig, device: str) -> None:
        self.recaption, self.clip_config, self.device = recaption, clip, device
        self.prompt = recaption.prompt or DEFAULT_PROMPT
        self.lexicon = load_lexicon(recaption.attribute_lexicons)
        # model calls and lazy loading, one thread at a time (re-entrant: loading the
        # grounding loads CLIP)
        self.lock = threading.RLock()
        # a model's generate calls, shared by every thread (a server's requests overlap
        # through its client instead)
        self.shared = SharedGenerate(self._generate, recaption.batch_size)

    @functools.cached_property
    def captioner(self) -> Captioner:
        from pairforge.recaption.constrain import blocked_words

        rc = self.recaption
        blocked = blocked_words(self.lexicon) if rc.constrained_decoding else None
        return load_captioner(rc, self.device, blocked)

    @functools.cached_property
    def clip(self) -> ClipScorer:
        """The clip section's model: clip grounding's scorer and the cache's embedding tier."""
        return ClipScorer(self.clip_config, self.device)

    @functools.cached_property
    def grounding(self) -> Grounding | None:
        return load_grounding(self.recaption.grounding, self.device,
                              lambda: self.clip)

    def _check(self, text: Answer) -> Checked:
        """(caption, attribute flags, problems) before grounding; no problems means usable."""
        if isinstance(text, Failure):
            return "", [], [FAILED + text.reason]
        caption = clean_caption(text, self.prompt)
        if not caption:
            return "", [], ["empty"]
        result = neutralize(caption, self.lexicon)
        flags = [f"attribute:{term}" for term in result.removed]
        return result.text, flags, [] if result.fluent else ["not_fluent"]

    def _attempt(self, images: list[Image.Image], embeddings: list[Any],
                 prompt: str) -> list[Checked]:
        if not images:
            return []
        checked = [self._check(text) for text in self._answers(images, prompt)]
        with self.lock:
            if self.grounding is None:
                return checked
            # one grounding call per batch: the detector backend batches its images
            unsupported = self.grounding.unsupported(
                images, [c or None for c, _, _ in checked], embeddings)
        return [(caption, flags, problems + [f"ungrounded:{noun}" for noun in nouns])
                for (caption, flags, problems), nouns in zip(checked, unsupported, strict=True)]

    def _answers(self, images: list[Image.Image], prompt: str) -> list[Answer]:
        """The backend's answers; a model's through the shared calls, a server's
        requests outside the lock."""
        captioner = self._loaded("captioner")
        if not captioner.concurrent:
            return self.shared.answers(images, [prompt] * len(images))
        return captioner.answers(images, prompt)

    def _generate(self, images: list[Image.Image], prompts: list[str]) -> list[Answer]:
        with self.lock:
            return self.captioner.answers(images, prompts)

    def _loaded(self, name: str) -> Any:
        """A model attribute, loaded under the lock the first time; once loaded, read
        without it, so a thread can queue its rows while another's generate runs."""
        if name in self.__dict__:
            return self.__dict__[name]
        with self.lock:
            return getattr(self, name)

    def close(self) -> None:
        """Close the backend's connections, if it was loaded."""
        captioner = self.__dict__.get("captioner")
        if captioner is not None:
            captioner.close()

    def caption_images(self, images: list[Image.Image],
                       embeddings: list[Any] | None = None) -> list[CachedCaption]:
        """Caption, check, regenerate the failures once with the strict prompt, or abstain;
        ``embeddings``: the images' CLIP embeddings when the caller has them."""
        with self.shared.caller():
            return self._caption(images, embeddings)

    def _caption(self, images: list[Image.Image],
                 embeddings: list[Any] | None) -> list[CachedCaption]:
        grounding = self._loaded("grounding")
        clip_vectors = grounding is not None and grounding.uses_clip_embeddings
        if clip_vectors and embeddings is None:  # once for both attempts
            with self.lock:
                embeddings = list(self.clip.embed_images(images))
        embeddings = embeddings if clip_vectors else [None] * len(images)
        first = self._attempt(images, embeddings, self.prompt)
        retry = [i for i, (_, _, problems) in enumerate(first)
                 if problems and not _failures(problems)]
        second = dict(zip(retry, self._attempt([images[i] for i in retry],
                                               [embeddings[i] for i in retry],
                                               self.prompt + STRICT_PROMPT), strict=True))
        return [_verdict(checked, second.get(i)) for i, checked in enumerate(first)]


def load_grounding(cfg: GroundingConfig, device: str,
                   clip: Callable[[], Any]) -> Grounding | None:
    """The configured backend, or None when grounding is off; ``clip`` returns the clip
    section's scorer (called only by the clip backend, so a detector loads no CLIP)."""
    if not cfg.enabled:
        return None
    lexicon = NounLexicon(cfg.extra_nouns)
    if cfg.backend == "detector":
        return DetectorGrounding(cfg.detector, lexicon, device)
    return ClipGrounding(clip(), lexicon, cfg.min_score)
