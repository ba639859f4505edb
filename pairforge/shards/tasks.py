"""t2i / i2t / img labels with an exact image-token budget (DESIGN.md section 5).

A unified model trained text-to-image with caption dropout ``p_drop`` spends ``p_drop`` of
its image tokens with no caption before the image. The budget-preserving recipe spends
that share on image-first ``i2t`` examples instead, so the share is counted in image
tokens, not examples, and i2t must be mixed through every shard, not staged.

The rule: walk a shard in key order keeping the running deficit
``D = p_drop * T - U`` (T all image tokens so far, U the unconditional ones: i2t and img).
A captioned sample of ``n`` tokens becomes i2t when taking it brings U closer to the
target, i.e. when ``D + p_drop * n >= n / 2``. Each step moves ``|D|`` to at most ``n / 2``,
so at every prefix the share is within half an image's tokens of the target (one image's
tokens once the seeded start offset is added). Samples with no trustworthy caption are
``img`` and always unconditional. The rule depends only on the shard's own rows and a
seed, so any number of workers gives the same labels.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

T2I, I2T, IMG = "t2i", "i2t", "img"


def start_offset(seed: int, shard_id: int) -> float:
    """A seeded phase in [-0.5, 0.5) (in units of the shard's first image), so shards do
    not all start with the same label."""
    digest = hashlib.sha256(f"{seed}:{shard_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 - 0.5


def assign_tasks(image_tokens: list[int] | np.ndarray, has_caption: list[bool] | np.ndarray,
                 p_drop: float, offset: float = 0.0) -> list[str]:
    """Labels for one shard's samples, in order (see the module docstring)."""
    if not 0.0 <= p_drop <= 1.0:
        raise ValueError(f"p_drop must be in [0, 1], got {p_drop}")
    tokens = np.asarray(image_tokens, dtype=np.int64)
    deficit = offset * float(tokens[0]) * min(p_drop, 1 - p_drop) * 2 if len(tokens) else 0.0
    labels = []
    for n, captioned in zip(tokens.tolist(), np.asarray(has_caption, bool).tolist(),
                            strict=True):
        deficit += p_drop * n
        if not captioned:
            labels.append(IMG)
            deficit -= n
        elif deficit >= n / 2:
            labels.append(I2T)
            deficit -= n
        else:
            labels.append(T2I)
    return labels


@dataclass(frozen=True)
class ShareReport:
    target: float
    realized: float  # unconditional (i2t + img) image tokens / all image tokens
    max_prefix_deviation: float  # max over prefixes of |U_k - p T_k|, in tokens
    max_image_tokens: int


def share_report(image_tokens: list[int] | np.ndarray, labels: list[str],
                 p_drop: float) -> ShareReport:
    tokens = np.asarray(image_tokens, dtype=np.int64)
    unconditional = np.where(np.isin(labels, [I2T, IMG]), tokens, 0)
    total_prefix = np.cumsum(tokens)
    uncond_prefix = np.cumsum(unconditional)
    deviation = np.abs(uncond_prefix - p_drop * total_prefix)
    total = int(total_prefix[-1]) if len(tokens) else 0
    return ShareReport(
        target=p_drop,
        realized=float(uncond_prefix[-1] / total) if total else 0.0,
        max_prefix_deviation=float(deviation.max()) if len(tokens) else 0.0,
        max_image_tokens=int(tokens.max()) if len(tokens) else 0,
    )
