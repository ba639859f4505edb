"""A shard's recaption stats (recaption/step.py's ``recaption_stats``), which the manifest
sums: a row the captioner never answered is counted as failed, not as abstained."""

from __future__ import annotations

from pairforge.recaption.step import recaption_stats


def _row(caption: str | None, origin: str | None, flags: list[str]) -> dict:
    return {"recaption": caption, "recaption_origin": origin, "recaption_flags": flags,
            "status": "ok", "caption_source": "recaption" if caption else "original"}


def test_failed_rows_are_not_counted_as_abstentions():
    stats = recaption_stats([
        _row("A dog.", "model", []),
        _row("A cat.", "cache", []),
        _row(None, "model", ["abstained:ungrounded:dog"]),  # the checks trusted nothing
        _row(None, "failed", ["failed:HTTP 500"]),  # the backend never answered
        _row(None, "failed", ["failed:timeout"]),
        _row(None, None, []),  # not recaptioned (an earlier step ended it)
    ])
    assert stats["rows"] == 5
    assert stats["origin"] == {"cache": 1, "failed": 2, "model": 2}
    assert stats["abstained"] == 1 and stats["failed"] == 2
    assert stats["flags"] == {"abstained:ungrounded": 1, "failed:HTTP 500": 1,
                              "failed:timeout": 1}
