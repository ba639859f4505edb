"""Basic filters (DataComp's 'basic' set): image size and shape, caption length, language.

Language identification uses py3langid, whose model ships inside the PyPI package, so it
works offline.
"""

from __future__ import annotations

import functools

import pyarrow as pa

from pairforge.config import BasicFilterConfig
from pairforge.records import Status
from pairforge.stage import Requirements, Step, StepConfig, StepResult, setting_values


@functools.cache
def _language_identifier():  # noqa: ANN202 - py3langid's own type
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def detect_language(text: str) -> str:
    return _language_identifier().classify(text)[0]


def check_row(cfg: BasicFilterConfig, caption: str | None, width: int,
              height: int) -> tuple[Status, str] | None:
    """The first failed rule as (status, detail), or None when the row passes."""
    return check_image(cfg, width, height) or check_caption(cfg, caption)


def check_image(cfg: BasicFilterConfig, width: int, height: int) -> tuple[Status, str] | None:
    """The first failed image rule (size, shape) as (status, detail), or None."""
    short, long = sorted((width, height))
    if short < cfg.min_image_side:
        return Status.TOO_SMALL, f"smaller side {short} px < {cfg.min_image_side}"
    if short and long / short > cfg.max_aspect_ratio:
        return Status.BAD_ASPECT, f"aspect ratio {long / short:.2f} > {cfg.max_aspect_ratio}"
    return None


def check_caption(cfg: BasicFilterConfig, caption: str | None) -> tuple[Status, str] | None:
    """The first failed caption rule (length, language) as (status, detail), or None;
    None for no caption (image-only rows have nothing to check)."""
    if caption is None:
        return None
    words, chars = len(caption.split()), len(caption)
    if words < cfg.min_caption_words or chars < cfg.min_caption_chars:
        return Status.CAPTION_TOO_SHORT, f"{words} words, {chars} characters"
    if ((cfg.max_caption_words and words > cfg.max_caption_words)
            or (cfg.max_caption_chars and chars > cfg.max_caption_chars)):
        return Status.CAPTION_TOO_LONG, f"{words} words, {chars} characters"
    if cfg.languages:
        language = detect_language(caption)
        if language not in cfg.languages:
            return Status.CAPTION_LANGUAGE, f"detected language {language!r}"
    return None


class BasicFilterStep(Step):
    """The image rules, and the caption rules on the alt-text unless the build is
    recaption-first: then the training-caption step applies them to every candidate
    (recaption/choice.py), and the alt-text alone decides nothing."""

    name = "basic"
    requires = ("caption", "original_width", "original_height")
    provides: dict[str, pa.DataType] = {}
    ends = (Status.TOO_SMALL, Status.BAD_ASPECT, Status.CAPTION_TOO_SHORT,
            Status.CAPTION_TOO_LONG, Status.CAPTION_LANGUAGE)

    @classmethod
    def enabled(cls, cfg: StepConfig) -> bool:
        return cfg.process.basic.enabled

    @classmethod
    def requirements(cls, cfg: StepConfig) -> Requirements:
        # py3langid's model ships inside its package: nothing to look for
        return Requirements(settings=setting_values(cfg.process.basic, "process.basic."))

    def process(self, rows: pa.Table) -> StepResult:
        cfg = self.cfg.process.basic
        captions = (rows["caption"].to_pylist() if not self.cfg.process.recaption_first()
                    else [None] * rows.num_rows)
        failures = [check_row(cfg, c, w, h) for c, w, h in zip(
            captions, rows["original_width"].to_pylist(),
            rows["original_height"].to_pylist(), strict=True)]
        return StepResult(status=[f[0].value if f else None for f in failures],
                          error=[f[1] if f else None for f in failures])
