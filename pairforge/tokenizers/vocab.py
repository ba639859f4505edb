"""The vocabulary layout shared by the shard writer and the trainer (DESIGN.md section 6).

    [0, V_text)            text ids
    [V_text, V_text + K)   image codes (code c is id V_text + c)
    V_text + K             SOV   start of image
    V_text + K + 1         EOV   end of image
    V_text + K + 2         EOS
    V_text + K + 3         PAD   (total_size = V_text + K + 4)

One object, written into manifest.json and read back by the trainer. Two layouts are
compatible only when every id means the same thing: same sizes and the same tokenizers
(compared by fingerprint digest, which ignores where the files were loaded from).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

SPECIALS = ("sov", "eov", "eos", "pad")


class VocabMismatch(ValueError):
    """Shards were tokenized with another layout than the one the reader expects."""


class VocabLayout(BaseModel):
    """Text ids, then image codes, then SOV, EOV, EOS, PAD."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text_vocab_size: int = Field(gt=0, description="V_text")
    image_codebook_size: int = Field(gt=0, description="K")
    text_tokenizer: dict[str, Any] = Field(
        default_factory=dict, description="text tokenizer fingerprint (backend, model, digest)")
    image_tokenizer: dict[str, Any] = Field(
        default_factory=dict,
        description="image tokenizer fingerprint (backend, model, resolution, digest)")

    @classmethod
    def from_tokenizers(cls, text: Any, image: Any) -> VocabLayout:
        """Layout for a TextTokenizer and an ImageTokenizer."""
        return cls(text_vocab_size=text.vocab_size, image_codebook_size=image.codebook_size,
                   text_tokenizer=text.fingerprint, image_tokenizer=image.fingerprint)

    # ------------------------------------------------------------------ derived ids
    @property
    def image_offset(self) -> int:
        return self.text_vocab_size

    @property
    def sov(self) -> int:
        return self.text_vocab_size + self.image_codebook_size

    @property
    def eov(self) -> int:
        return self.sov + 1

    @property
    def eos(self) -> int:
        return self.sov + 2

    @property
    def pad(self) -> int:
        return self.sov + 3

    @property
    def total_size(self) -> int:
        return self.sov + len(SPECIALS)

    # ------------------------------------------------------------------ mapping
    def image_ids(self, codes: np.ndarray) -> np.ndarray:
        """Image codes (any shape) -> vocabulary ids, int32; refuses codes outside [0, K)."""
        codes = np.asarray(codes)
        if codes.size and (codes.min() < 0 or codes.max() >= self.image_codebook_size):
            raise ValueError(f"image codes must be in [0, {self.image_codebook_size}), got "
                             f"[{codes.min()}, {codes.max()}]")
        return (codes.astype(np.int64) + self.image_offset).astype(np.int32)

    # ------------------------------------------------------------------ manifest
    def to_manifest(self) -> dict[str, Any]:
        """Plain JSON: the inputs plus every derived id, so a reader can see them."""
        return {
            "text_vocab_size": self.text_vocab_size,
            "image_codebook_size": self.image_codebook_size,
            "image_offset": self.image_offset,
            **{name: getattr(self, name) for name in SPECIALS},
            "total_size": self.total_size,
            "order": ["text", "image", *(s.upper() for s in SPECIALS)],
            "text_tokenizer": self.text_tokenizer,
            "image_tokenizer": self.image_tokenizer,
        }

    @classmethod
    def from_manifest(cls, data: dict[str, Any]) -> VocabLayout:
        """Read back :meth:`to_manifest`; derived ids written there must agree."""
        layout = cls(text_vocab_size=data["text_vocab_size"],
                     image_codebook_size=data["image_codebook_size"],
                     text_tokenizer=data.get("text_tokenizer", {}),
                     image_tokenizer=data.get("image_tokenizer", {}))
        written = {k: data[k] for k in ("image_offset", *SPECIALS, "total_size") if k in data}
        derived = {k: getattr(layout, k) for k in written}
        if written != derived:
            raise VocabMismatch(f"manifest vocabulary ids {written} disagree with the layout "
                                f"they were derived from {derived}")
        return layout

    # ------------------------------------------------------------------ compatibility
    def describe(self) -> str:
        """One line naming sizes, ids and tokenizers, for error messages and logs."""
        return (f"V_text={self.text_vocab_size} ({_name(self.text_tokenizer)}), "
                f"K={self.image_codebook_size} ({_name(self.image_tokenizer)}), "
                f"SOV={self.sov} EOV={self.eov} EOS={self.eos} PAD={self.pad}, "
                f"total={self.total_size}")

    def check_compatible(self, other: VocabLayout, this: str = "model",
                         that: str = "shards") -> None:
        """Raise :class:`VocabMismatch` naming both layouts unless every id means the same."""
        problems = []
        if self.text_vocab_size != other.text_vocab_size:
            problems.append("text vocabulary size")
        if self.image_codebook_size != other.image_codebook_size:
            problems.append("image codebook size")
        for field in ("text_tokenizer", "image_tokenizer"):
            mine, theirs = _digest(getattr(self, field)), _digest(getattr(other, field))
            if mine and theirs and mine != theirs:
                problems.append(field.replace("_", " "))
        if problems:
            raise VocabMismatch(
                f"vocabulary layouts differ ({', '.join(problems)}):\n"
                f"  {this}: {self.describe()}\n  {that}: {other.describe()}")


def _digest(fingerprint: dict[str, Any]) -> str | None:
    return fingerprint.get("digest") if fingerprint else None


def _name(fingerprint: dict[str, Any]) -> str:
    if not fingerprint:
        return "tokenizer unknown"
    parts = [str(fingerprint.get("backend", "?")), str(fingerprint.get("model", "?"))]
    if fingerprint.get("resolution"):
        parts.append(f"{fingerprint['resolution']}px")
    if fingerprint.get("digest"):
        parts.append(f"digest {fingerprint['digest']}")
    return " ".join(parts)

