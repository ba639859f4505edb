"""Where the stage-3 steps (pairforge/stage.py) run on Ray Data.

Model steps run in actor pools that load their model once per actor; other steps run as
plain Ray tasks. The frame knows nothing about which models run: a new step is a class
(on the contract in stage.py), a config section and its line in pipeline/chain.py.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import pyarrow as pa

from pairforge.config import ConfigError, ModelPoolConfig, PairforgeConfig
from pairforge.device_decode import on_device
from pairforge.images import (
    ImageView,
    decode_view_blocks,
    decode_views,
    model_device,
    unique_views,
)
from pairforge.pipeline.contract import TASK_CPU_RESERVE, TASK_CPUS, step_config
from pairforge.pipeline.executors import data_pool, data_tasks
from pairforge.pipeline.ray_private import cut_into_blocks
from pairforge.stage import ModelStep, Step, StepConfig


def _run_plain_step(step_cls: type[Step], cfg: StepConfig, batch: pa.Table,
                    drop: tuple[str, ...] = ()) -> pa.Table:
    step = step_cls(cfg)
    try:
        return step(batch, drop)
    finally:
        step.teardown()


def fit_actor_cpus(steps: list[type[Step]], cfg: PairforgeConfig,
                   cluster_cpus: float) -> dict[str, float]:
    """CPUs per actor for each model step, scaled down so all pools fit beside the tasks
    (``TASK_CPU_RESERVE``: stage 3's contract)."""
    handed = step_config(cfg)
    pools = {s.name: s.pool_config(handed) for s in steps if issubclass(s, ModelStep)}
    demand = sum(p.pool_size * p.num_cpus for p in pools.values())
    budget = max(cluster_cpus - TASK_CPU_RESERVE, 0.05 * demand)
    scale = min(1.0, budget / demand) if demand else 1.0
    return {name: round(p.num_cpus * scale, 4) for name, p in pools.items()}


def gpu_demand(steps: list[type[Step]], cfg: PairforgeConfig) -> list[tuple[str, float]]:
    """Each model pool's GPUs as ``(what it is, GPUs)``: ``pool_size x num_gpus`` of every
    model step that runs, by its config key. Ray Data runs every pool at once, so the
    demand is their sum; a step that shares another step's section (a second pool on the
    same settings) counts again."""
    handed = step_config(cfg)
    demand = []
    for step in steps:
        if not issubclass(step, ModelStep):
            continue
        pool = step.pool_config(handed)
        if pool.num_gpus:
            key = _section_key(cfg, pool)
            demand.append((f"{step.name}: {key}.pool_size {pool.pool_size} x {key}.num_gpus "
                           f"{pool.num_gpus:g}", pool.pool_size * pool.num_gpus))
    return demand


def check_gpu_demand(steps: list[type[Step]], cfg: PairforgeConfig,
                     cluster_gpus: float) -> None:
    """Raise ``ConfigError`` (exit 2) naming every pool when the pools ask for more GPUs
    than the cluster has: Ray Data would wait for them forever, without a word. Fractional
    ``num_gpus`` share a GPU (0.25 x 4 is one)."""
    demand = gpu_demand(steps, cfg)
    total = sum(gpus for _, gpus in demand)
    if total > cluster_gpus + 1e-9:
        lines = [f"{what} = {gpus:g} GPUs" for what, gpus in demand]
        raise ConfigError(f"process cannot start: the model pools ask for {total:g} GPUs at "
                          f"once and the cluster has {cluster_gpus:g}:\n  " + "\n  ".join(lines)
                          + "\n  lower pool_size or num_gpus (fractions share a GPU)")


def check_decode_device(steps: list[type[Step]], cfg: PairforgeConfig) -> None:
    """Raise ``ConfigError`` (exit 2) when ``process.decode.device`` is cuda and the first
    model step's actors hold no GPU to decode on."""
    if cfg.process.decode.device != "cuda":
        return
    handed = step_config(cfg)
    first = next((s for s in steps if issubclass(s, ModelStep)), None)
    pool = first.pool_config(handed) if first else None
    if pool is None or not pool.num_gpus:
        where = (f"the first model step, {first.name}, asks {_section_key(cfg, pool)}.num_gpus "
                 "0" if first and pool else "no model step runs")
        raise ConfigError(f"process.decode.device cuda decodes on the first model step's GPU, "
                          f"and {where}: give it num_gpus or set process.decode.device: cpu")


def _section_key(cfg: PairforgeConfig, pool: ModelPoolConfig) -> str:
    """The dotted key of a pool's section in ``cfg.process`` (classifiers by index)."""
    for name in type(cfg.process).model_fields:
        value = getattr(cfg.process, name)
        if value is pool:
            return f"process.{name}"
        if isinstance(value, list):
            for i, item in enumerate(value):
                if item is pool:
                    return f"process.{name}[{i}]"
    return "process.?"


# Rows per block through the model steps. Ray Data's executor (stage 3's coordinator
# task, pipeline/stream.py; the driver before issue 48) spends CPU on every block of every
# operator: cut to the smallest batch size (16 rows),
# stage 3 cost the driver 93 CPU-seconds per 10^5 rows on the cheap chain (~30 % of a
# core) and 6.6 at 1,024 rows, which also ran 1.34x the rows/s (bench/stage3.py, issue 48).
# A 10^4-row shard still spreads over ten actor tasks.
BLOCK_ROWS = 1024


def add_steps(ds: Any, steps: list[type[Step]], cfg: PairforgeConfig,
              actor_cpus: dict[str, float], drop_after: tuple[str, ...] = (),
              block_rows: int = BLOCK_ROWS) -> Any:
    """Append the step chain; the last step drops the ``drop_after`` columns. Before the
    first model step, cut the blocks into blocks of ``block_rows`` rows (or the largest
    model ``batch_size``). A shard arrives as one block, and one block goes to one actor:
    cut, it spreads over every actor of a pool, several model calls per actor task. The
    plain steps before it stay fused with the reading task, one task per shard. Each row's
    image is decoded once into every picture the steps read (``chain_views``), where
    ``process.decode.where`` says; the last step drops those columns."""
    if not steps:
        # Ray asks a whole CPU for this task by default (see _cut_into_blocks)
        return ds.drop_columns(list(drop_after), num_cpus=TASK_CPUS)
    handed = step_config(cfg)
    batch_sizes = [s.pool_config(handed).call_rows for s in steps if issubclass(s, ModelStep)]
    views = chain_views(steps, handed)
    drop_after = (*drop_after, *(v.column for v in views))
    in_actor = handed.process.decode.where == "actor"
    cut = False
    groups = step_groups(steps, handed)
    for i, group in enumerate(groups):
        decode: tuple[ImageView, ...] = ()
        if issubclass(group[0], ModelStep) and not cut:
            ds = _cut_into_blocks(ds, max(*batch_sizes, block_rows))
            ds, decode = (ds, views) if in_actor else (_decode_views(ds, views), ())
            cut = True
        drop = drop_after if i == len(groups) - 1 else ()
        ds = (add_step(ds, group[0], handed, actor_cpus, drop, decode=decode)
              if len(group) == 1 else add_fused(ds, group, handed, actor_cpus, drop, decode))
    return ds


def _fusable(step: type[Step], cfg: StepConfig) -> bool:
    """A model step that may share its actors with its neighbours: no GPU, no custom
    resource (where its actors run is then anywhere), one batch at a time."""
    if not issubclass(step, ModelStep):
        return False
    pool = step.pool_config(cfg)
    return not pool.num_gpus and not pool.resources and step.concurrent_batches(cfg) <= 1


def step_groups(steps: list[type[Step]], cfg: StepConfig) -> list[list[type[Step]]]:
    """The chain as it runs, in order: with ``process.fuse_model_steps``, each run of
    fusable model steps, with the plain steps between them, is one group (one actor
    pool, ``FusedSteps``); every other step is a group of its own."""
    if not cfg.process.fuse_model_steps:
        return [[step] for step in steps]
    groups: list[list[type[Step]]] = []
    fused: list[type[Step]] | None = None
    between: list[type[Step]] = []  # plain steps since the open group's last model step
    for step in steps:
        if _fusable(step, cfg) and fused is not None:
            fused += [*between, step]
            between = []
        elif _fusable(step, cfg):
            fused = [step]
            groups.append(fused)
        elif fused is not None and not issubclass(step, ModelStep):
            between.append(step)
        else:
            groups += [[s] for s in between] + [[step]]
            fused, between = None, []
    return groups + [[s] for s in between]


def chain_views(steps: list[type[Step]], cfg: StepConfig) -> tuple[ImageView, ...]:
    """Every picture the chain's steps read, each once (``images.ImageView``); none when
    each step decodes for itself (``process.decode.where: steps``)."""
    if cfg.process.decode.where == "steps":
        return ()
    return unique_views(v for s in steps for v in s.image_views(cfg))


def _decode_views(ds: Any, views: tuple[ImageView, ...]) -> Any:
    # A CPU task per block ahead of the pools: decoding overlaps the models' work. The
    # pictures are arrays, not JPEGs (a 256-px row is ~200 KB a view, ~600 MB for a
    # 1,024-row block of three views), so the task hands on a block per ~64 MiB decoded.
    if not views:
        return ds
    return data_tasks(ds, decode_view_blocks, TASK_CPUS, fn_kwargs={"views": views})


class DecodingStep:
    """The first model step's actor when ``process.decode.where`` is ``actor``: it runs two
    calls at once, each decoding its batch's views in its own thread (Pillow lets go of
    the GIL) while the other call's forward runs. Forwards take turns under a lock unless
    the step is thread-safe itself (``concurrent_batches`` above 1)."""

    def __init__(self, step_cls: type[ModelStep], cfg: StepConfig,
                 views: tuple[ImageView, ...]) -> None:
        self.step, self.views = step_cls(cfg), views
        threaded = step_cls.concurrent_batches(cfg) > 1
        self.turns = contextlib.nullcontext() if threaded else threading.Lock()
        self.decoder = None  # Pillow
        if cfg.process.decode.device == "cuda":
            if model_device(step_cls.pool_config(cfg)) != "cuda":
                raise RuntimeError(f"process.decode.device is cuda, and {step_cls.name}'s "
                                   "actor sees no CUDA device")
            self.decoder = on_device("cuda")

    def __call__(self, batch: pa.Table, drop: tuple[str, ...] = ()) -> pa.Table:
        batch = decode_views(batch, self.views, self.decoder)
        with self.turns:
            return self.step(batch, drop)


class FusedSteps:
    """A group of ``step_groups`` in one actor: its model steps loaded once, its plain
    steps made per call (as their tasks do); a batch goes through them in order, each
    model step called on at most its own ``batch_size`` rows at a time. With ``views``,
    the actor decodes them first, in a second thread beside the other call's steps (as
    ``DecodingStep``)."""

    def __init__(self, group: tuple[type[Step], ...], cfg: StepConfig,
                 views: tuple[ImageView, ...] = ()) -> None:
        self.cfg, self.views = cfg, views
        self.steps = [step(cfg) if issubclass(step, ModelStep) else step for step in group]
        self.turns = threading.Lock()

    def __call__(self, batch: pa.Table, drop: tuple[str, ...] = ()) -> pa.Table:
        if self.views:
            batch = decode_views(batch, self.views)
        with self.turns:
            for i, step in enumerate(self.steps):
                last = drop if i == len(self.steps) - 1 else ()
                if isinstance(step, type):
                    batch = _run_plain_step(step, self.cfg, batch, last)
                    continue
                rows = type(step).pool_config(self.cfg).call_rows
                batch = pa.concat_tables([step(batch.slice(at, rows), last)
                                          for at in range(0, max(batch.num_rows, 1), rows)],
                                         promote_options="permissive")
        return batch


def add_fused(ds: Any, group: list[type[Step]], cfg: StepConfig,
              actor_cpus: dict[str, float] | None, drop: tuple[str, ...],
              decode: tuple[ImageView, ...]) -> Any:
    """Append a fused group: one pool of ``FusedSteps``, as many actors as its largest
    pool, each reserving the most CPUs any of its steps asks (they run one after another,
    not side by side)."""
    models = [step for step in group if issubclass(step, ModelStep)]
    pools = [step.pool_config(cfg) for step in models]
    num_cpus = max((actor_cpus or {}).get(step.name, pool.num_cpus)
                   for step, pool in zip(models, pools, strict=True))
    return data_pool(ds, FusedSteps, size=max(p.pool_size for p in pools),
                     batch_size=max(p.call_rows for p in pools), num_cpus=num_cpus,
                     concurrent=2 if decode else 1, constructor_args=(tuple(group), cfg, decode),
                     fn_kwargs={"drop": drop})


def _cut_into_blocks(ds: Any, rows: int) -> Any:
    # Ray asks one CPU for each repartition task, which the actor pools may all hold: the
    # stage would hang. At the plain tasks' fraction Ray fuses it into the task before it.
    return cut_into_blocks(ds, rows, num_cpus=TASK_CPUS)


def add_step(ds: Any, step_cls: type[Step], cfg: StepConfig,
             actor_cpus: dict[str, float] | None = None, drop: tuple[str, ...] = (),
             decode: tuple[ImageView, ...] = ()) -> Any:
    """Append one step to a Ray dataset: an actor pool for models, tasks otherwise. No
    other operator may follow an actor pool unless it asks for at most ``TASK_CPUS``:
    Ray's default of one CPU would wait until the pools are gone, at the end of the run.
    ``decode``: the views a model step's actors decode ahead of it (``DecodingStep``)."""
    if issubclass(step_cls, ModelStep):
        pool = step_cls.pool_config(cfg)
        num_cpus = (actor_cpus or {}).get(step_cls.name, pool.num_cpus)
        extra: dict[str, Any] = {}
        if pool.num_gpus:
            extra["num_gpus"] = pool.num_gpus
        if pool.resources:
            extra["resources"] = pool.resources
        concurrent = step_cls.concurrent_batches(cfg)
        if concurrent > 1:
            # one batch per block: an actor's concurrent calls are blocks, and blocks of
            # many batches would need that many blocks queued on each actor
            ds = _cut_into_blocks(ds, pool.call_rows)
        actor, args = (DecodingStep, (step_cls, cfg, decode)) if decode else (step_cls, (cfg,))
        return data_pool(ds, actor, size=pool.pool_size, batch_size=pool.call_rows,
                         num_cpus=num_cpus, concurrent=max(concurrent, 2 if decode else 1),
                         constructor_args=args, fn_kwargs={"drop": drop}, **extra)
    return data_tasks(ds, functools.partial(_run_plain_step, step_cls, cfg), TASK_CPUS,
                      fn_kwargs={"drop": drop})
