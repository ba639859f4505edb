"""t2i / i2t / img labels with an exact image-token budget (DESIGN.md section 5).

A unified model trained text-to-image with caption dropout ``p_drop`` spends ``p_drop`` of
its image tokens with no caption before the image. The budget-preserving recipe spends
that share on image-first ``i2t`` examples instead, so the share is counted in image
tokens, not examples, and i2t must be mixed through every shard, not staged.

Samples with no trustworthy caption are ``img`` and always unconditional, so the i2t
share of the captioned tokens is ``r = (p_drop * T - IMG) / C`` over the shard (T all
image tokens, IMG those of img samples, C those of captioned ones; clipped to [0, 1]):
then i2t + img tokens are ``p_drop`` of the shard's image tokens. The writer has the whole
shard, so it knows T, IMG and C before labelling.

The rule: walk the captioned samples in key order keeping the running deficit
``D = r * C_k - I_k`` (C_k captioned tokens so far, I_k the i2t ones). A sample of ``n``
tokens becomes i2t when taking it brings I_k closer to the target, i.e. when
``D + r * n >= n / 2``. Each step leaves ``|D| <= n / 2``, so at every prefix the i2t share
is within half an image's tokens of the target (one image's tokens with the seeded start
offset, which keeps shards from all starting alike). The rule depends only on the shard's
own rows and a seed, so any number of workers gives the same labels.
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


def i2t_rate(image_tokens: np.ndarray, has_caption: np.ndarray, p_drop: float) -> float:
    """The i2t share of captioned tokens that makes i2t + img tokens ``p_drop`` of all."""
    captioned = float(image_tokens[has_caption].sum())
    if not captioned:
        return 0.0
    uncaptioned = float(image_tokens[~has_caption].sum())
    wanted = p_drop * float(image_tokens.sum()) - uncaptioned
    return min(max(wanted / captioned, 0.0), 1.0)


def assign_tasks(image_tokens: list[int] | np.ndarray, has_caption: list[bool] | np.ndarray,
                 p_drop: float, offset: float = 0.0) -> list[str]:
    """Labels for one shard's samples, in order (see the module docstring)."""
    if not 0.0 <= p_drop <= 1.0:
        raise ValueError(f"p_drop must be in [0, 1], got {p_drop}")
    tokens = np.asarray(image_tokens, dtype=np.int64)
    captioned = np.asarray(has_caption, dtype=bool)
    rate = i2t_rate(tokens, captioned, p_drop)
    first = float(tokens[captioned][0]) if captioned.any() else 0.0
    deficit = offset * first * min(rate, 1 - rate) * 2
    labels = []
    for n, has in zip(tokens.tolist(), captioned.tolist(), strict=True):
        if not has:
            labels.append(IMG)
            continue
        deficit += rate * n
        if deficit >= n / 2:
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
