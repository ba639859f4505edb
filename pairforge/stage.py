"""The step contract every stage-3 step implements (DESIGN.md section 2). No Ray here.

A step is a small class: it declares the columns it reads (``requires``), the columns it
adds (``provides``, typed) and the statuses it may end rows with (``ends``), and processes
only the rows whose status is still ``ok``; rows that left earlier pass through untouched,
so every row reaches the writer and the funnel adds up. ``ModelStep`` subclasses load
their model once in ``__init__`` and say what they need from the cluster in
``pool_config``; where they run is ``pipeline/``'s business, not theirs.

Each call also records how long ``process`` took, spread over the rows it processed, in a
``step_seconds.NAME`` column; the writer turns it and the statuses a step ``ends`` into the
shard's per-step stats (rows in and out, rows ended by status, seconds) and drops it.

Two optional hooks cover what a step owns beyond one batch: ``build_scope`` (a context
around the whole stage-3 run, e.g. a shared registry) and ``finish_shard`` (called by the
writer once a shard's rows are final, before its stats file marks it complete; what it
returns goes into the shard's stats under the step's name).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pairforge.config import ModelPoolConfig, PairforgeConfig
from pairforge.records import Status


@dataclass
class StepResult:
    """What a step computed for the ok rows it was given, aligned with those rows."""

    columns: dict[str, pa.Array | list] = field(default_factory=dict)
    status: list[str | None] | None = None  # a new status per row, or None to keep ok
    error: list[str | None] | None = None


class Step:
    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[dict[str, pa.DataType]] = {}
    ends: ClassVar[tuple[Status, ...]] = ()  # the statuses this step may give a row

    def __init__(self, cfg: PairforgeConfig) -> None:
        self.cfg = cfg

    def process(self, rows: pa.Table) -> StepResult:
        raise NotImplementedError

    def teardown(self) -> None:
        """Release what ``__init__`` took (files, connections); the default holds nothing."""

    @classmethod
    @contextlib.contextmanager
    def build_scope(cls, cfg: PairforgeConfig) -> Iterator[None]:
        """Around the whole stage-3 run, on the driver (e.g. a registry the actors share)."""
        yield

    @classmethod
    def finish_shard(cls, cfg: PairforgeConfig, shard_id: int,
                     rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Once a shard's rows are final, before it is marked complete; returns its stats."""
        return None

    def __call__(self, batch: pa.Table, drop: tuple[str, ...] = ()) -> pa.Table:
        """The batch with this step's columns; ``drop``: columns no later step needs."""
        missing = [c for c in self.requires if c not in batch.column_names]
        if missing:
            raise KeyError(f"step {self.name} needs columns {missing}")
        ok = pc.equal(batch["status"], Status.OK.value).to_numpy(zero_copy_only=False)
        index = np.flatnonzero(ok)
        started = time.perf_counter()
        result = self.process(batch.take(index)) if len(index) else StepResult()
        per_row = (time.perf_counter() - started) / max(len(index), 1)
        self._check_statuses(result)
        batch = merge_result(batch, index, result, self.provides)
        seconds = _scatter(np.full(len(index), per_row, np.float32), index, batch.num_rows,
                           pa.float32())
        return batch.append_column(SECONDS_PREFIX + self.name, seconds).drop_columns(list(drop))

    def _check_statuses(self, result: StepResult) -> None:
        unknown = {s for s in result.status or [] if s is not None} - set(self.ends)
        if unknown:
            raise ValueError(f"step {self.name} set statuses {sorted(unknown)} it does not "
                             f"declare in `ends` {[s.value for s in self.ends]}")


SECONDS_PREFIX = "step_seconds."


def step_stats(steps: list[type[Step]], rows_in: int,
               rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per step over one shard: rows in and out, rows it ended by status, seconds in
    ``process``. ``rows_in``: the rows the first step was given (the shard's rows to
    process); ``rows``: the shard's final rows, with their ``step_seconds.*`` values."""
    stats = {}
    enders = [_ending_step(steps, r) for r in rows]
    for step in steps:
        ended = Counter(r["status"] for r, by in zip(rows, enders, strict=True)
                        if by == step.name)
        seconds = sum(r.get(SECONDS_PREFIX + step.name) or 0.0 for r in rows)
        rows_out = rows_in - sum(ended.values())
        stats[step.name] = {"rows_in": rows_in, "rows_out": rows_out,
                            "ended": dict(sorted(ended.items())), "seconds": round(seconds, 3)}
        rows_in = rows_out
    return stats


def _ending_step(steps: list[type[Step]], row: dict[str, Any]) -> str | None:
    """The step that ended a row. Several classifiers may share a status (two NSFW models
    both ending rows ``unsafe``): then it is the last of them that processed the row (a
    step is timed on exactly the rows it was given)."""
    candidates = [s for s in steps if row["status"] in s.ends]
    if len(candidates) > 1:
        timed = [s for s in candidates if row.get(SECONDS_PREFIX + s.name) is not None]
        candidates = timed[-1:] or candidates
    return candidates[0].name if candidates else None


class ModelStep(Step):
    """A step whose class is an actor: ``__init__`` loads the model once per actor."""

    @classmethod
    def pool_config(cls, cfg: PairforgeConfig) -> ModelPoolConfig:
        raise NotImplementedError

    def __init__(self, cfg: PairforgeConfig) -> None:
        super().__init__(cfg)
        threads = self.pool_config(cfg).torch_threads
        if threads:
            import torch

            torch.set_num_threads(threads)

    def __del__(self) -> None:
        # Ray Data deletes an actor's step when its pool shuts down gracefully
        self.teardown()


def _scatter(values: pa.Array | list, index: np.ndarray, length: int,
             dtype: pa.DataType) -> pa.Array:
    """A full-length column: ``values`` at the rows in ``index``, null elsewhere."""
    positions = np.full(length, -1, dtype=np.int64)
    positions[index] = np.arange(len(index))
    taker = pa.array(positions, mask=positions < 0)  # a null index takes a null
    return pa.array(values, dtype).take(taker)


def merge_result(batch: pa.Table, index: np.ndarray, result: StepResult,
                 provides: dict[str, pa.DataType]) -> pa.Table:
    """Put a step's per-ok-row output back into the full batch."""
    n = batch.num_rows
    for name, dtype in provides.items():
        values = result.columns.get(name, [None] * len(index))
        column = _scatter(values, index, n, dtype)
        if name in batch.column_names:
            # A later pass may fill a column an earlier one left null: keep the known values.
            column = pc.coalesce(column, batch[name].cast(dtype))
            batch = batch.set_column(batch.column_names.index(name), name, column)
        else:
            batch = batch.append_column(name, column)
    if result.status is not None:
        status = batch["status"].to_pylist()
        error = batch["error"].to_pylist()
        for i, new_status, new_error in zip(index, result.status, result.error or [],
                                            strict=False):
            if new_status is not None:
                status[i], error[i] = new_status, new_error
        batch = batch.set_column(batch.column_names.index("status"), "status",
                                 pa.array(status, pa.string()))
        batch = batch.set_column(batch.column_names.index("error"), "error",
                                 pa.array(error, pa.string()))
    return batch
