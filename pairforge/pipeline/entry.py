"""What every stage's entry point shares: ``run_X(cfg, RunOptions) -> summary``.

The entry points are ``download_stage.run_download``, ``dedup_stage.run_dedup_stage`` and
``process.run_process``; ``pairforge build`` calls them in order with one ``RunOptions``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from pairforge.shards.raw import stats_name
from pairforge.shards.storage import OutputDir


@dataclass(frozen=True)
class RunOptions:
    """How a run goes, whichever stages it runs.

    ``force``: redo complete shards made under other settings (``--redo-changed``; stage
    2: redo a finished dedup even when it matches its inputs). ``redo_all``: redo every
    shard, complete or not, whatever its settings (``--force``, which sets ``force`` too).
    ``show_progress``: the live display, else plain lines. ``checked``: the stages whose
    settings this run has already checked (``settings.check_settings`` returns the options
    with them added), so that the check reads the stats files once per run: ``build``
    checks every stage before stage 1.
    """

    force: bool = False
    redo_all: bool = False
    show_progress: bool = True
    checked: frozenset[str] = frozenset()


def summarise(out: OutputDir, folder: str, shard_ids: list[int]) -> dict[str, Any]:
    """The funnel over the given complete shards, read back from their stats files."""
    counts: Counter = Counter()
    for shard_id in shard_ids:
        counts.update(out.read_json(folder, stats_name(shard_id))["status"])
    return {"shards": len(shard_ids), "rows": sum(counts.values()), "status": dict(counts)}
