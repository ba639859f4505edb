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

A step also answers, from its ``StepConfig`` alone (the process section and the few
settings of other parts it reads, by name: never the whole config), what the run around
it needs to know: whether it runs (``enabled``), what it loads and which settings shape
its output (``requirements``: its sources, ``sources.py``'s kinds, check themselves when
preflight asks; the settings digest records the values and fingerprints the local files;
the start-up line names the model), what every shard's stats record of it
(``stage_stats``), what the manifest says of it (``manifest_entries``) and which pictures
of a row it reads (``image_views``: the chain decodes each row once, ahead of the model
pools, and hands them along). Preflight, the settings digest, the progress line and the
manifest ask these; none of them names a step's models or settings.

A ``ScoringStep`` can also score the whole stage in a pass of its own before the writing
pass (a threshold learned from every score; embeddings for semantic dedup): the driver
runs the chain up to it, keeps its score and embedding columns per shard, merges the
per-shard state it asks for, and the writing pass reads the cached columns back.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from pairforge.config import ModelPoolConfig, OutputConfig, ProcessConfig
from pairforge.images import ImageView
from pairforge.records import Status, end_rows
from pairforge.sources import ModelSource


@dataclass(frozen=True)
class StepConfig:
    """What a stage-3 step is handed: stage 3's own section, and each setting of another
    part that a step reads, by name (``pipeline/contract.py`` builds it from the whole
    config; no step sees that)."""

    process: ProcessConfig
    output: OutputConfig  # the recaption cache's default folder, the build's id
    exact_dedup: bool  # dedup.enabled: stage 2 has dropped every pixel-identical copy
    semantic_dedup: bool  # dedup.semantic.enabled: the semantic pass reads the embeddings

    def with_process(self, process: ProcessConfig) -> StepConfig:
        return replace(self, process=process)


@dataclass(frozen=True)
class Requirements:
    """What a step needs and what shapes its output, from the config alone (no model is
    loaded): the answer preflight, the settings digest and the start-up line ask for."""

    display: str | None = None  # the model the start-up line names the step by
    sources: tuple[ModelSource, ...] = ()  # what it loads, each checked before any work
    settings: dict[str, Any] = field(default_factory=dict)  # {dotted key: value}


def setting_values(section: BaseModel, prefix: str,
                   skip: Collection[str] = ()) -> dict[str, Any]:
    """``{PREFIX.dotted.key: value}`` of a config section, as the settings digest records
    it, without the ``skip`` keys (dotted, under the section, with all they hold). A model
    step's section leaves out how its pool runs: ModelPoolConfig's fields change speed,
    not bytes."""
    if isinstance(section, ModelPoolConfig):
        skip = {*skip, *ModelPoolConfig.model_fields}
    return flat_values(section.model_dump(mode="json"), prefix, frozenset(skip))


def flat_values(value: Any, prefix: str, skip: Collection[str] = (),
                at: str = "") -> dict[str, Any]:
    """A nested mapping as ``{PREFIX.dotted.key: leaf}``, without the keys in ``skip``
    (dotted paths under the mapping)."""
    if not isinstance(value, dict):
        return {(prefix + at).rstrip("."): value}
    flat: dict[str, Any] = {}
    for key, inner in value.items():
        path = f"{at}{key}"
        if path not in skip:
            flat.update(flat_values(inner, prefix, skip, f"{path}."))
    return flat


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

    def __init__(self, cfg: StepConfig) -> None:
        self.cfg = cfg

    @classmethod
    def enabled(cls, cfg: StepConfig) -> bool:
        """Whether the step runs under ``cfg`` (its section's ``enabled``)."""
        return True

    @classmethod
    def requirements(cls, cfg: StepConfig) -> Requirements:
        """What it loads and which settings shape its output, as configured (also while it
        is off: its settings are recorded either way, so turning it on is one change)."""
        return Requirements()

    @classmethod
    def image_views(cls, cfg: StepConfig) -> tuple[ImageView, ...]:
        """The pictures of a row it reads (``images.ImageView``): the chain decodes each
        row once ahead of the model pools and prepares each view once (none: it reads no
        image)."""
        return ()

    @classmethod
    def stage_stats(cls, cfg: StepConfig) -> dict[str, Any]:
        """Entries every shard's stats file (and the run's summary) records of it."""
        return {}

    @classmethod
    def manifest_entries(cls, cfg: StepConfig, first: dict[str, Any],
                         totals: dict[str, Any]) -> dict[str, Any]:
        """What the manifest says of it, by section: a mapping updates the section
        (``{"models": {...}}``), a list extends it. ``first``: the first shard's stats ({}
        when there is none; the manifest is folded over the shards, never holds them all);
        ``totals``: its rows in and out, rows ended and seconds over all the shards."""
        return {}

    def process(self, rows: pa.Table) -> StepResult:
        raise NotImplementedError

    def teardown(self) -> None:
        """Release what ``__init__`` took (files, connections); the default holds nothing."""

    @classmethod
    @contextlib.contextmanager
    def build_scope(cls, cfg: StepConfig, rows: int) -> Iterator[None]:
        """Around the whole stage-3 run, on the driver (e.g. a registry the actors share);
        ``rows``: the rows the run processes, what such state is sized by."""
        yield

    @classmethod
    def finish_shard(cls, cfg: StepConfig, shard_id: int,
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
    def pool_config(cls, cfg: StepConfig) -> ModelPoolConfig:
        raise NotImplementedError

    @classmethod
    def concurrent_batches(cls, cfg: StepConfig) -> int:
        """How many batches one actor works on at once, each in its own thread (above 1,
        ``process`` must be thread-safe): a step that waits on a server rather than
        computing keeps its requests in flight across batches. A model runs one."""
        return 1

    def __init__(self, cfg: StepConfig) -> None:
        super().__init__(cfg)
        threads = self.pool_config(cfg).torch_threads
        if threads:
            import torch

            torch.set_num_threads(threads)

    def __del__(self) -> None:
        # Ray Data deletes an actor's step when its pool shuts down gracefully
        self.teardown()


# Applies a function to the scores of groups of shards; yields its results.
ScoreMap = Callable[[Callable[[np.ndarray], Any]], Iterable[Any]]


class ScoringStep(Step):
    """A step that can score the whole stage in a pass of its own before the writing pass:
    the chain up to it runs under ``scoring_config`` over every shard, and its
    ``score_column`` (a score file per shard) and ``embedding_column`` (OUT/embeddings) are
    kept. The writing pass reads them back into its rows, and the step skips the rows that
    come scored. A threshold learned from the scores (``needs_scoring_pass``) comes from
    ``learn``, which sees the scores only through functions run next to the score files."""

    score_column: ClassVar[str]
    embedding_column: ClassVar[str | None] = None

    @classmethod
    def needs_scoring_pass(cls, cfg: StepConfig) -> bool:
        """Whether its decisions need every score of the stage first."""
        return False

    @classmethod
    def scoring_config(cls, cfg: StepConfig, for_embeddings: bool) -> StepConfig:
        """The config the scoring pass runs under: scores, no decisions. ``for_embeddings``:
        the pass runs for the embeddings of every scored row (semantic dedup)."""
        raise NotImplementedError

    @classmethod
    def learn(cls, cfg: StepConfig, over_scores: ScoreMap
              ) -> tuple[StepConfig, dict[str, Any]]:
        """What the step learns from every shard's scores: the config the writing pass runs
        under and the stats entries that record it. ``over_scores(fn)`` applies ``fn`` to
        the non-null scores of groups of shards, wherever the files are (in tasks), and
        yields the results in any order; ``fn``'s results must add up across groups, so the
        driver holds only what the step keeps of them (e.g. histograms), never the scores."""
        raise NotImplementedError

    @classmethod
    def score_cut(cls, cfg: StepConfig) -> float | None:
        """The score at or above which the writing pass keeps a row (None: every one)."""
        return None

    @classmethod
    def saves_embeddings(cls, cfg: StepConfig) -> bool:
        """Whether the writing pass writes the embeddings (else the column is dropped
        before the writer, which has no use for it)."""
        return False


def scoring_step(steps: list[type[Step]]) -> type[ScoringStep] | None:
    """The chain's step with a scoring pass: the first (OUT's score files hold one score)."""
    return next((s for s in steps if issubclass(s, ScoringStep)), None)


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
        errors = result.error or [None] * len(result.status)
        batch = end_rows(batch, {int(i): (status, error) for i, status, error
                                 in zip(index, result.status, errors, strict=True)
                                 if status is not None})
    return batch
