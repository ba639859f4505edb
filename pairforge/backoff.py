"""Waiting before a retry: the one parser of ``Retry-After`` and the one backoff rule.

Ground floor (no pipeline imports): the download stage's fetcher and the OpenAI-compatible
captioning client both retry HTTP requests and must read the header the same way.

The delay grows as ``base x 2^attempt`` (capped), and jitter spreads the clients that failed
together, so they do not come back together. Two policies, by what the caller needs:

* ``"full"`` (AWS's "full jitter"): uniform in [0, ceiling]. Stage 1's fetcher, whose many
  threads and tasks hit one host at once; spreading them matters more than a floor.
* ``"equal"`` ("equal jitter"): uniform in [ceiling / 2, ceiling]. The captioning client,
  one request per batch, which should not come back at once either.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from typing import Literal

Jitter = Literal["full", "equal"]


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta seconds or HTTP date)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def backoff_delay(attempt: int, base: float, jitter: Jitter, cap: float = math.inf,
                  rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (0 for the first): ``base x 2^attempt``,
    at most ``cap``, jittered by the ``jitter`` policy; ``rng``: a seeded generator (tests),
    else the module's."""
    ceiling = min(base * 2**attempt, cap)
    draw = rng or random
    if jitter == "full":
        return draw.uniform(0.0, ceiling)
    return ceiling * (0.5 + draw.random() / 2)


def full_jitter(base: float, attempt: int, rng: random.Random | None = None) -> float:
    """A retry delay in [0, base x 2^attempt] (the fetcher's policy)."""
    return backoff_delay(attempt, base, "full", rng=rng)


def backoff_seconds(attempt: int, retry_after: str | None = None, *, base: float = 0.5,
                    cap: float = 30.0, retry_after_cap: float = 60.0) -> float:
    """The server's ``Retry-After`` when it gives one (capped), else ``backoff_delay`` with
    equal jitter (the captioning client's policy)."""
    asked = parse_retry_after(retry_after)
    if asked is not None:
        return min(asked, retry_after_cap)
    return backoff_delay(attempt, base, "equal", cap)
