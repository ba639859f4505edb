"""Training sequences and what each target position measures (DESIGN.md sections 5 and 7).

    t2i  [EOS] c [SOV] x [EOV] [EOS]
    i2t  [EOS] [SOV] x [EOV] c [EOS]
    img  [EOS] [SOV] x [EOV] [EOS]

Position j of a sequence predicts token j + 1. Every position is a target except padding:
caption tokens of t2i and image tokens of i2t stay targets, because masking them would
change what the image-token budget buys. Each target gets a *kind*, so the loss can be
split into L_I|T (image after a caption), L_I|0 (image with no caption before it), L_T|I
(caption after an image), caption-first text, and the special tokens; the kinds partition
the targets, so the split sums to the total.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from pairforge.shards.labels import I2T, IMG, T2I
from pairforge.tokenizers.vocab import VocabLayout

TASKS = (T2I, I2T, IMG)


class Kind(IntEnum):
    PAD = 0  # not a target
    IMAGE_AFTER_CAPTION = 1  # L_I|T
    IMAGE_NO_CAPTION = 2  # L_I|0
    CAPTION_AFTER_IMAGE = 3  # L_T|I
    CAPTION_FIRST = 4  # t2i captions: text with nothing before it
    SPECIAL = 5  # SOV, EOV, EOS


METRICS = {"L_I|T": Kind.IMAGE_AFTER_CAPTION, "L_I|0": Kind.IMAGE_NO_CAPTION,
           "L_T|I": Kind.CAPTION_AFTER_IMAGE, "L_T": Kind.CAPTION_FIRST,
           "L_special": Kind.SPECIAL}


@dataclass(frozen=True)
class Sequence:
    tokens: np.ndarray  # int64, length L
    kinds: np.ndarray  # int64, length L - 1: the kind of the target tokens[j + 1]
    task: str  # as trained (after the recipe)
    label: str  # as written in the shard
    n_image_tokens: int


def trained_task(label: str, recipe: str, has_caption: bool = True) -> str:
    """The task a sample trains as: baseline turns i2t into caption-dropped img examples."""
    if label == I2T and recipe == "baseline":
        return IMG
    if label in (T2I, I2T) and not has_caption:
        return IMG
    return label


def build_sequence(label: str, caption: np.ndarray, codes: np.ndarray, layout: VocabLayout,
                   recipe: str = "replacement") -> Sequence:
    """The sequence and target kinds of one sample (codes: image codes, any shape)."""
    task = trained_task(label, recipe, has_caption=len(caption) > 0)
    image = layout.image_ids(np.asarray(codes).reshape(-1)).astype(np.int64)
    text = np.asarray(caption, dtype=np.int64).reshape(-1)
    if text.size and (text.min() < 0 or text.max() >= layout.text_vocab_size):
        raise ValueError(f"caption ids outside [0, {layout.text_vocab_size})")
    eos, sov, eov = [np.array([t], np.int64) for t in (layout.eos, layout.sov, layout.eov)]
    special = np.array([Kind.SPECIAL])
    n_img, n_txt = len(image), len(text)
    if task == T2I:
        parts = [eos, text, sov, image, eov, eos]
        kinds = [np.full(n_txt, Kind.CAPTION_FIRST), special,
                 np.full(n_img, Kind.IMAGE_AFTER_CAPTION), special, special]
    elif task == I2T:
        parts = [eos, sov, image, eov, text, eos]
        kinds = [special, np.full(n_img, Kind.IMAGE_NO_CAPTION), special,
                 np.full(n_txt, Kind.CAPTION_AFTER_IMAGE), special]
    else:
        parts = [eos, sov, image, eov, eos]
        kinds = [special, np.full(n_img, Kind.IMAGE_NO_CAPTION), special, special]
    return Sequence(np.concatenate(parts), np.concatenate(kinds).astype(np.int64), task, label,
                    n_img)


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, T) int64, PAD after each sequence's end
    targets: torch.Tensor  # (B, T) int64
    kinds: torch.Tensor  # (B, T) int64, Kind.PAD where the target is padding
    tasks: torch.Tensor  # (B,) index into TASKS, as trained
    labels: list[str]  # as labelled in the shards
    image_tokens: torch.Tensor  # (B,) image tokens per sequence

    def to(self, device: torch.device) -> Batch:
        return Batch(self.inputs.to(device), self.targets.to(device), self.kinds.to(device),
                     self.tasks.to(device), self.labels, self.image_tokens.to(device))


def collate(sequences: list[Sequence], pad: int) -> Batch:
    """Right-pad to the longest sequence; causal attention never lets a real position see
    the padding after it, so no attention mask is needed, only the loss mask."""
    width = max(len(s.tokens) for s in sequences) - 1
    inputs = torch.full((len(sequences), width), pad, dtype=torch.int64)
    targets = torch.full_like(inputs, pad)
    kinds = torch.full_like(inputs, int(Kind.PAD))
    for i, seq in enumerate(sequences):
        n = len(seq.tokens) - 1
        inputs[i, :n] = torch.from_numpy(seq.tokens[:-1])
        targets[i, :n] = torch.from_numpy(seq.tokens[1:])
        kinds[i, :n] = torch.from_numpy(seq.kinds)
    tasks = torch.tensor([TASKS.index(s.task) for s in sequences], dtype=torch.int64)
    image_tokens = torch.tensor([s.n_image_tokens for s in sequences], dtype=torch.int64)
    return Batch(inputs, targets, kinds, tasks, [s.label for s in sequences], image_tokens)
