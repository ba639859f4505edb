"""Waiting before a retry: the one parser of ``Retry-After`` and the backoff rule.

Ground floor (no pipeline imports): the download stage's fetcher and the OpenAI-compatible
captioning client both retry HTTP requests and must read the header the same way.
"""

from __future__ import annotations

import email.utils
import random
import time


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


def backoff_seconds(attempt: int, retry_after: str | None = None, *, base: float = 0.5,
                    cap: float = 30.0, retry_after_cap: float = 60.0) -> float:
    """The server's ``Retry-After`` when it gives one (capped), else exponential backoff
    with jitter, so that many clients retrying at once do not stay in step."""
    asked = parse_retry_after(retry_after)
    if asked is not None:
        return min(asked, retry_after_cap)
    return min(base * 2 ** attempt, cap) * (0.5 + random.random() / 2)
