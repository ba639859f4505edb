"""The failure breakdown: which hosts lost the most rows in stage 1, and why.

Each raw shard's stats keep ``failures_by_host``: its ``SHARD_TOP`` hosts by failed rows
(rows not ok after stage 1), each with its rows per status, and the failed rows of its
other hosts (``other_hosts``), so the shard's failures always add up. The manifest folds
the shards' sections into a bounded table (``HostFailures``: at most ``KEPT`` hosts,
pruned to them whenever it holds twice as many, as Misra-Gries does), so the driver's
memory does not grow with the number of shards or hosts. The top of it is exact for a
host that is among the ``SHARD_TOP`` of every shard it failed in and never pruned; other
counts are lower bounds, and ``other_hosts`` holds the rest.
"""

from __future__ import annotations

from collections import Counter
from typing import Any
from urllib.parse import urlsplit

SHARD_TOP = 20  # hosts per shard's stats
KEPT = 1000  # hosts the fold keeps
SHOWN = 10  # hosts inspect and report show


def host_of(url: str | None) -> str:
    """The host (with its port, if the URL names one) of a row's URL; "(none)" when it has
    none or is not a URL."""
    try:
        return urlsplit(url or "").netloc.lower() or "(none)"
    except ValueError:
        return "(none)"


class HostFailures:
    """Failed rows per host and status, bounded to ``keep`` hosts."""

    def __init__(self, keep: int = KEPT) -> None:
        self.keep = keep
        self.hosts: dict[str, Counter[str]] = {}
        self.other_hosts = 0  # failed rows of hosts not (or no longer) in ``hosts``

    def add_row(self, host: str, status: str) -> None:
        self.hosts.setdefault(host, Counter())[status] += 1

    def add_section(self, section: dict[str, Any]) -> None:
        """Fold in a ``section()`` (a shard's, or a part's)."""
        for entry in section.get("hosts", []):
            self.hosts.setdefault(entry["host"], Counter()).update(entry["status"])
        self.other_hosts += section.get("other_hosts", 0)
        if len(self.hosts) > 2 * self.keep:
            self._prune(self.keep)

    def _prune(self, keep: int) -> None:
        ranked = sorted(self.hosts.items(), key=lambda kv: (-kv[1].total(), kv[0]))
        for _, counts in ranked[keep:]:
            self.other_hosts += counts.total()
        self.hosts = dict(ranked[:keep])

    def section(self, top: int) -> dict[str, Any]:
        """The ``top`` hosts by failed rows (ties by name), with their statuses, and the
        failed rows of every other host."""
        ranked = sorted(self.hosts.items(), key=lambda kv: (-kv[1].total(), kv[0]))
        rest = sum(counts.total() for _, counts in ranked[top:])
        return {"hosts": [{"host": host, "failed": counts.total(),
                           "status": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))}
                          for host, counts in ranked[:top]],
                "other_hosts": self.other_hosts + rest}


def merge_sections(sections: list[dict[str, Any]], top: int = SHARD_TOP) -> dict[str, Any]:
    """Sections (a shard's parts) as one, cut to ``top`` hosts."""
    fold = HostFailures()
    for section in sections:
        fold.add_section(section)
    return fold.section(top)


def breakdown_rows(section: dict[str, Any] | None) -> list[list[Any]]:
    """``[host, failed rows, status, rows, meaning]`` per host and status, the host's
    cells only on its first line; then the rows of the other hosts; what inspect and
    report show."""
    from pairforge.records import STATUS_HELP

    rows: list[list[Any]] = []
    for entry in (section or {}).get("hosts", []):
        for i, (status, n) in enumerate(entry["status"].items()):
            rows.append([entry["host"] if i == 0 else "", entry["failed"] if i == 0 else "",
                         status, n, STATUS_HELP.get(status, "")])
    if section and section.get("other_hosts"):
        rows.append(["(other hosts)", section["other_hosts"], "", "", ""])
    return rows


def breakdown_note(section: dict[str, Any] | None) -> str | None:
    """What the table cannot say: shards written before the breakdown existed."""
    if section is None:
        return "no failure breakdown: the manifest was written before pairforge kept one"
    missing = section.get("shards_without_breakdown", 0)
    if missing:
        return (f"{missing:,} raw shards were written before pairforge kept a failure "
                "breakdown: their failures are not in this table")
    return None
