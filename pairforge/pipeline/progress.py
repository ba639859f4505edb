"""Live progress of a stage (shards, rows/s, failures by reason) and the final summary."""

from __future__ import annotations

import time
from collections import Counter

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from pairforge.records import Status

console = Console(stderr=True)


class ProgressCounter:
    """Ray actor body: tasks add per-status counts; the driver reads the running total."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def add(self, delta: dict[str, int]) -> None:
        self.counts.update(delta)

    def total(self) -> dict[str, int]:
        return dict(self.counts)


class StageDisplay:
    """A rich Live view refreshed by the driver while it waits on Ray."""

    def __init__(self, stage: str, shards_total: int, rows_total: int, shards_skipped: int):
        self.stage, self.shards_total, self.rows_total = stage, shards_total, rows_total
        self.shards_done = shards_skipped
        self.started = time.monotonic()
        self.counts: dict[str, int] = {}
        self.live = Live(self._render(), console=console, refresh_per_second=4,
                         transient=True)

    def __enter__(self) -> StageDisplay:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)

    def update(self, counts: dict[str, int], shards_done: int) -> None:
        self.counts, self.shards_done = counts, shards_done
        self.live.update(self._render())

    def _render(self) -> Group:
        rows = sum(self.counts.values())
        elapsed = max(time.monotonic() - self.started, 1e-6)
        failures = {k: v for k, v in self.counts.items() if k != Status.OK}
        head = Text.assemble(
            (f"{self.stage}: ", "bold"),
            f"shards {self.shards_done}/{self.shards_total}  ",
            f"rows {rows:,}/{self.rows_total:,}  ",
            f"{rows / elapsed:,.1f} rows/s  ",
            (f"ok {self.counts.get(Status.OK, 0):,}", "green"))
        fail = Text("  ".join(f"{k} {v:,}" for k, v in sorted(failures.items())), style="red")
        return Group(head, fail)
