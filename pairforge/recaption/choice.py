"""The training caption: one declared column (``train_caption``), decided here only.

Every later reader (the tokenize step, the shard writer, the trainer's samples) takes the
``train_caption`` column and its ``caption_source``; none of them chooses again. The step
runs in every build: without recaptioning the choice is the original caption.

In a recaption-first build (config.recaption_first) the alt-text has decided nothing so
far, and this step is where the caption rules meet the candidates: the recaption and the
alt-text (unless stage 1 found it unusable: ``caption_issue``). ``recaption`` takes the
recaption; ``mix`` its seeded draw, else the other (a junk alt-text drawn does not cost
the row); each only if the basic caption rules pass it. A row with none ends with the
failed rule, stays an ``img`` sample when the captioner abstained but the alt-text was
usable (as in every build), or ends ``caption_abstained`` when the captioner abstained on
an image without usable alt-text.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pairforge.config import BasicFilterConfig
from pairforge.filters.basic import check_caption
from pairforge.records import Status, process_columns
from pairforge.stage import Requirements, Step, StepConfig, StepResult, setting_values


def mix_draw(share: float, seed: int, key: str) -> str:
    """The seeded mix's source for a row: recaption with probability ``share``."""
    draw = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")
    return "recaption" if draw / 2**64 < share else "original"


def training_caption(choice: str, share: float, seed: int, key: str, original: str | None,
                     recaption: str | None) -> tuple[str | None, str | None]:
    """(training caption, caption_source) in an alt-text-first build; (None, None) when no
    caption can be trusted (an ``img`` sample)."""
    if choice == "mix":
        choice = mix_draw(share, seed, key)
    if choice == "original":
        return (original, "original") if original else (None, None)
    return (recaption, "recaption") if recaption else (None, None)


@dataclass(frozen=True)
class Choice:
    """A recaption-first row's training caption, or why it has none (a status)."""

    text: str | None = None
    source: str | None = None
    status: Status | None = None
    error: str | None = None


def first_passing(order: list[tuple[str, str | None]], rules: BasicFilterConfig | None,
                  usable_alt_text: bool, alt_text_issue: str | None) -> Choice:
    """The first candidate (source, text) in ``order`` the caption rules pass (None: no
    rules); a missing one (an abstained recaption) is skipped. With none: the first failed
    rule; else, with a usable alt-text the preference left out, an ``img`` sample, as in
    every build; else the captioner abstained on an image with no usable alt-text."""
    failed: Choice | None = None
    for source, text in order:
        if text is None:
            continue
        broken = check_caption(rules, text) if rules else None
        if broken is None:
            return Choice(text, source)
        failed = failed or Choice(status=broken[0], error=f"{source}: {broken[1]}")
    if failed or usable_alt_text:
        return failed or Choice()
    return Choice(status=Status.CAPTION_ABSTAINED,
                  error=f"the captioner abstained and the alt-text is {alt_text_issue}")


def recaption_first_choice(choice: str, share: float, seed: int, key: str,
                           candidates: dict[str, str | None], alt_text_issue: str | None,
                           rules: BasicFilterConfig | None,
                           scores: dict[str, float | None] | None = None) -> Choice:
    """The training caption of a recaption-first row (module docstring). ``candidates``:
    source -> text (recaption, recaption_2, original: the alt-text as read; a junk one is
    no candidate); ``scores``: source -> CLIP score, which ``best`` ranks by."""
    usable = candidates.get("original") if alt_text_issue is None else None
    present = {**candidates, "original": usable}
    if choice == "recaption":
        order = ["recaption"]
    elif choice == "mix":
        first = mix_draw(share, seed, key)
        order = [first, "original" if first == "recaption" else "recaption"]
    else:  # best: every candidate, the highest score first (ties: recaption first)
        ranked = [s for s in present if present[s] is not None
                  and (scores or {}).get(s) is not None]
        order = sorted(ranked, key=lambda s: -(scores or {})[s])
    return first_passing([(s, present.get(s)) for s in order], rules, usable is not None,
                         alt_text_issue or "missing")


class TrainingCaptionStep(Step):
    """Chooses each ok row's training caption (recaption, original or a seeded mix)."""

    name = "training_caption"
    requires = ("key", "caption", "caption_issue")  # and ``recaption`` when it runs
    provides = process_columns("caption_source", "train_caption")
    # recaption-first only: the caption rules judge the candidates here
    ends = (Status.CAPTION_TOO_SHORT, Status.CAPTION_TOO_LONG, Status.CAPTION_LANGUAGE,
            Status.CAPTION_ABSTAINED)

    @classmethod
    def requirements(cls, cfg: StepConfig) -> Requirements:
        return Requirements(settings=setting_values(cfg.process.tasks, "process.tasks."))

    def __init__(self, cfg: StepConfig) -> None:
        super().__init__(cfg)
        self.choice = cfg.process.training_caption()
        self.tasks = cfg.process.tasks

    def process(self, rows: pa.Table) -> StepResult:
        recaptions = (rows["recaption"].to_pylist() if "recaption" in rows.column_names
                      else [None] * rows.num_rows)
        if self.cfg.process.recaption_first():
            return self._recaption_first(rows, recaptions)
        chosen = [training_caption(self.choice, self.tasks.recaption_share, self.tasks.seed,
                                   key, original, recaption)
                  for key, original, recaption in zip(rows["key"].to_pylist(),
                                                      rows["caption"].to_pylist(), recaptions,
                                                      strict=True)]
        return StepResult(columns={"caption_source": [source for _, source in chosen],
                                   "train_caption": [text for text, _ in chosen]})

    def _recaption_first(self, rows: pa.Table, recaptions: list[str | None]) -> StepResult:
        basic = self.cfg.process.basic
        rules = basic if basic.enabled else None
        columns = {source: _column(rows, source) for source in ("recaption_2",)}
        scores = {source: _column(rows, f"clip_score_{source}") for source in SOURCES}
        originals, issues = rows["caption"].to_pylist(), rows["caption_issue"].to_pylist()
        chosen = []
        for i, key in enumerate(rows["key"].to_pylist()):
            candidates = {"recaption": recaptions[i], "recaption_2": columns["recaption_2"][i],
                          "original": originals[i]}
            chosen.append(recaption_first_choice(
                self.choice, self.tasks.recaption_share, self.tasks.seed, key, candidates,
                issues[i], rules, {s: v[i] for s, v in scores.items()}))
        return StepResult(columns={"caption_source": [c.source for c in chosen],
                                   "train_caption": [c.text for c in chosen]},
                          status=[c.status.value if c.status else None for c in chosen],
                          error=[c.error for c in chosen])

    @classmethod
    def finish_shard(cls, cfg: StepConfig, shard_id: int,
                     rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Which caption trained how many of the shard's samples."""
        trained = Counter(r.get("caption_source") or "none" for r in rows
                          if r["status"] == Status.OK.value)
        return {"samples_by_caption": dict(sorted(trained.items()))}


SOURCES = ("recaption", "recaption_2", "original")  # what caption_source may say


def _column(rows: pa.Table, name: str) -> list[Any]:
    return rows[name].to_pylist() if name in rows.column_names else [None] * rows.num_rows
