"""The training caption: one declared column (``train_caption``), decided here only.

Every later reader (the tokenize step, the shard writer, the trainer's samples) takes the
``train_caption`` column and its ``caption_source``; none of them chooses again. The step
runs in every build: without recaptioning the choice is the original caption.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

from pairforge.config import PairforgeConfig
from pairforge.records import process_columns
from pairforge.stage import Requirements, Step, StepResult, setting_values


def training_caption(choice: str, share: float, seed: int, key: str, original: str | None,
                     recaption: str | None) -> tuple[str | None, str | None]:
    """(training caption, caption_source); (None, None) when no caption can be trusted."""
    if choice == "mix":
        draw = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")
        choice = "recaption" if draw / 2**64 < share else "original"
    if choice == "original":
        return (original, "original") if original else (None, None)
    return (recaption, "recaption") if recaption else (None, None)


class TrainingCaptionStep(Step):
    """Chooses each ok row's training caption (recaption, original or a seeded mix)."""

    name = "training_caption"
    requires = ("key", "caption")  # and ``recaption`` when the recaption step runs
    provides = process_columns("caption_source", "train_caption")

    @classmethod
    def requirements(cls, cfg: PairforgeConfig) -> Requirements:
        return Requirements(settings=setting_values(cfg.process.tasks, "process.tasks."))

    def __init__(self, cfg: PairforgeConfig) -> None:
        super().__init__(cfg)
        self.choice = cfg.process.training_caption()
        self.tasks = cfg.process.tasks

    def process(self, rows: pa.Table) -> StepResult:
        recaptions = (rows["recaption"].to_pylist() if "recaption" in rows.column_names
                      else [None] * rows.num_rows)
        chosen = [training_caption(self.choice, self.tasks.recaption_share, self.tasks.seed,
                                   key, original, recaption)
                  for key, original, recaption in zip(rows["key"].to_pylist(),
                                                      rows["caption"].to_pylist(), recaptions,
                                                      strict=True)]
        return StepResult(columns={"caption_source": [source for _, source in chosen],
                                   "train_caption": [text for text, _ in chosen]})
