"""Live progress of a stage (shards, rows/s, failures by reason) and the final summary."""

from __future__ import annotations

import logging
import time

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

# The actor class lives in a module that imports nothing heavy (its worker imports it).
from pairforge.pipeline.counter import ProgressCounter as ProgressCounter
from pairforge.records import Status

# messages keep paths and keys in one piece: no wrapping inserted at the terminal width
console = Console(stderr=True, soft_wrap=True)
LOG = logging.getLogger("pairforge")


def format_duration(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``; ``?`` when unknown."""
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return (f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60
            else f"{minutes}:{secs:02d}")


def say(message: str) -> None:
    """A line at once, before something slow (Ray starting, models loading), on stderr and
    in the run log."""
    console.print(message, markup=False, highlight=False)
    LOG.info(message)


PLAIN_INTERVAL_S = 10.0  # a plain progress line at most this often


class StageDisplay:
    """A stage's progress while the driver waits on Ray: rows done per status, rows through
    each step, rate, elapsed time and ETA. On a terminal a rich Live view; with ``live``
    False (``-q``) or when stderr is not a terminal (CI logs, a pipe) a plain line every
    ``interval`` seconds instead, and one at the start and at the end. The plain lines go
    into the run log too."""

    def __init__(self, stage: str, shards_total: int, rows_total: int, shards_skipped: int,
                 live: bool = True, interval: float = PLAIN_INTERVAL_S):
        self.stage, self.shards_total, self.rows_total = stage, shards_total, rows_total
        self.shards_done = shards_skipped
        self.started = self.printed = time.monotonic()
        self.interval = interval
        self.counts: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.live = (Live(self._render(), console=console, refresh_per_second=4,
                          transient=True) if live and console.is_terminal else None)

    def __enter__(self) -> StageDisplay:
        if self.live:
            self.live.__enter__()
        else:
            self._print()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.__exit__(*exc)
        if not self.live or exc[0] is None:
            self._print(log_only=bool(self.live))

    def update(self, counts: dict[str, int], shards_done: int,
               steps: dict[str, int] | None = None) -> None:
        """``counts``: rows finished by status; ``steps``: rows each step has passed."""
        self.counts, self.shards_done = counts, shards_done
        self.steps = steps if steps is not None else self.steps
        if self.live:
            self.live.update(self._render())
        elif time.monotonic() - self.printed >= self.interval:
            self._print()

    def _print(self, log_only: bool = False) -> None:
        self.printed = time.monotonic()
        line = self.line()
        if not log_only:
            console.print(line, markup=False, highlight=False)
        LOG.info(line)

    def _pace(self) -> tuple[int, float, float, float]:
        """Rows done, rows/s, seconds elapsed, seconds left (inf before the first row)."""
        rows = sum(self.counts.values())
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = rows / elapsed
        left = (self.rows_total - rows) / rate if rate else float("inf")
        return rows, rate, elapsed, left

    def line(self) -> str:
        """The plain progress line."""
        rows, rate, elapsed, left = self._pace()
        share = f" ({rows / self.rows_total:.0%})" if self.rows_total else ""
        ended = ", ".join(f"{k} {v:,}" for k, v in sorted(
            self.counts.items(), key=lambda kv: (kv[0] != Status.OK, kv[0])))
        steps = ", ".join(f"{name} {n:,}" for name, n in self.steps.items())
        return (f"{self.stage}: shards {self.shards_done}/{self.shards_total}, rows "
                f"{rows:,}/{self.rows_total:,}{share}, {rate:,.1f} rows/s, elapsed "
                f"{format_duration(elapsed)}, ETA {format_duration(left)}"
                + (f"; {ended}" if ended else "") + (f"; through steps: {steps}" if steps
                                                     else ""))

    def _render(self) -> Group:
        rows, rate, elapsed, left = self._pace()
        failures = {k: v for k, v in self.counts.items() if k != Status.OK}
        head = Text.assemble(
            (f"{self.stage}: ", "bold"),
            f"shards {self.shards_done}/{self.shards_total}  ",
            f"rows {rows:,}/{self.rows_total:,}  ",
            f"{rate:,.1f} rows/s  elapsed {format_duration(elapsed)}  "
            f"ETA {format_duration(left)}  ",
            (f"ok {self.counts.get(Status.OK, 0):,}", "green"))
        steps = Text("through steps: " + "  ".join(
            f"{name} {n:,}" for name, n in self.steps.items()) if self.steps else "")
        fail = Text("  ".join(f"{k} {v:,}" for k, v in sorted(failures.items())), style="red")
        return Group(head, steps, fail)
