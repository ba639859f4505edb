"""A stage-1 shard written in parts (the run's tail), joined into the shard.

``shards/raw.py`` joins the parts' files and counts the merged rows; what only stage 1's
stats hold is added up here, so the file layer below needs nothing of stage 1: the memory
guard's peak, the consent gate's counts, the failures by host and the politeness counts.
"""

from __future__ import annotations

from typing import Any

from pairforge.download.consent import merge_stats as merge_consent
from pairforge.download.politeness import merge_stats as merge_politeness
from pairforge.shards import raw
from pairforge.shards.failures import merge_sections as merge_failures
from pairforge.shards.storage import OutputDir


def merge_parts(out: OutputDir, folder: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """``shards.raw.merge_parts`` with stage 1's sections added up; the shard's stats."""
    return raw.merge_parts(out, folder, parts, stage_sections)


def stage_sections(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage 1's own sections of a shard's stats, over its parts (their ``close`` stats)."""
    first, sections = parts[0], {}
    if first.get("peak_resident_mib") is not None:  # the memory guard's samples
        sections["peak_resident_mib"] = max(p["peak_resident_mib"] or 0 for p in parts)
    if "consent" in first:  # counts per reason and host: every part's
        sections["consent"] = merge_consent([p["consent"] for p in parts])
    if "failures_by_host" in first:
        sections["failures_by_host"] = merge_failures([p["failures_by_host"] for p in parts])
    if "politeness" in first:  # per host: throttled requests, backoffs, pauses
        sections["politeness"] = merge_politeness([p["politeness"] for p in parts])
    return sections
