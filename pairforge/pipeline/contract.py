"""Every stage's contract, in one place: what it reads of the config, what it reads and
writes under OUT, what its work asks Ray for, and what its settings digest covers.

The four stages run on three executors (pipeline/executors.py: bounded tasks for stage
1, waves for stage 2 and the semantic pass; Ray Data for stage 3), but each declares
itself here the same way. ``pipeline/settings.py`` reads ``digest`` to fingerprint a
stage's settings; the drivers read ``resources``; a setting two stages share is said once
(``SHARED``) and handed to each stage from here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pairforge.config import PairforgeConfig
from pairforge.download.lists import list_fingerprints
from pairforge.download.shard import ShardConfig
from pairforge.download.split import SPLIT_FOLDER
from pairforge.shards.storage import (
    DEDUP_FOLDER,
    EMBEDDINGS_FOLDER,
    MANIFEST,
    RAW_FOLDER,
    SCORES_FOLDER,
    SHARDS_FOLDER,
)
from pairforge.stage import StepConfig


def recaption_first(cfg: PairforgeConfig) -> bool:
    """Whether the training caption may come from the recaption: stage 1 then ends no row
    for its alt-text, and stage 3 judges captions after recaptioning (DESIGN.md section 1)."""
    return cfg.process.recaption_first()


# The settings more than one stage reads, by the key the settings digests record them
# under: every stage's digest records them, and each stage is handed their values.
SHARED: dict[str, Callable[[PairforgeConfig], Any]] = {
    "process.recaption_first": recaption_first,
}


def shared_settings(cfg: PairforgeConfig) -> dict[str, Any]:
    return {key: value(cfg) for key, value in SHARED.items()}


def section(cfg: PairforgeConfig, dotted: str) -> Any:
    """The config section at a dotted path (``process.tasks``)."""
    return functools.reduce(getattr, dotted.split("."), cfg)


@dataclass(frozen=True)
class Digest:
    """What a stage's settings digest covers: config sections (dotted path: the keys left
    out, which change how fast and how politely, not what is written), values derived from
    the config, and (stage 3) every step's settings and model-file fingerprints
    (``Step.requirements``). Stage 2 and the semantic pass, one output made from all their
    inputs, add the inputs they name (files by name and size, the digests they were made
    under)."""

    sections: dict[str, tuple[str, ...]]
    derived: Callable[[PairforgeConfig], dict[str, Any]] | None = None
    steps: bool = False
    inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resources:
    """What the stage's work asks Ray for: CPUs per task (``read_cpus``: a task that only
    reads files), how many tasks at once given the cluster's CPUs (None: a whole wave is
    submitted and Ray queues it), and (stage 3) the CPUs kept free of the model steps'
    actor pools, each pool sized by its step's ``pool_config``."""

    task_cpus: float
    read_cpus: float | None = None
    in_flight: Callable[[PairforgeConfig, int], int] | None = None
    pools: bool = False
    cpu_reserve: float = 0.0


def _always(cfg: PairforgeConfig) -> bool:
    return True


def _when_dedup(cfg: PairforgeConfig) -> bool:
    return cfg.dedup.enabled


@dataclass(frozen=True)
class StageInput:
    """What a stage reads: a name under OUT (shards/storage.py's) or a config key. An
    earlier stage's output names that stage (``made_by``) and when a run of this stage
    cannot start without it (``needed``; None: optional, e.g. a cache it reuses when there):
    preflight asks each such input whether it is there, and names the stage to run first."""

    name: str
    made_by: str | None = None
    needed: Callable[[PairforgeConfig], bool] | None = None


@dataclass(frozen=True)
class StageContract:
    name: str
    sections: tuple[str, ...]  # the config sections its code is handed
    inputs: tuple[StageInput, ...]
    outputs: tuple[str, ...]  # folders under OUT: a run ends with no temporary left in them
    resources: Resources
    digest: Digest
    shared: tuple[str, ...] = field(default=tuple(SHARED))
    output_files: tuple[str, ...] = ()  # files under OUT


# process keys of no step's section that move work, never bytes: no digest records them
PROCESS_SPEED_KEYS = ("fuse_model_steps",)
DOWNLOAD_SPEED_KEYS = ("threads", "image_threads", "processes", "per_host_connections",
                       "timeout", "retries", "backoff", "max_retry_after", "user_agent",
                       "per_host_requests_per_s", "per_host_burst", "host_failures",
                       "host_pause_s", "host_max_pauses", "max_task_memory_mb")


def _download_derived(cfg: PairforgeConfig) -> dict[str, Any]:
    # the list files' fingerprints; robots.txt and X-Robots-Tag match the product token
    # (the header itself, with its version and contact URL, is not a setting)
    return {**list_fingerprints(cfg.download, cfg.input.storage_options),
            "download.agent_token": cfg.download.agent_token.lower()}


DOWNLOAD = StageContract(
    "download", sections=("input", "download", "output", "ray"),
    inputs=(StageInput("input.path"), StageInput(SPLIT_FOLDER)),
    outputs=(SPLIT_FOLDER, RAW_FOLDER),
    resources=Resources(task_cpus=1,
                        in_flight=lambda cfg, cpus: cfg.download.processes or cpus),
    digest=Digest({"input": ("storage_options",), "download": DOWNLOAD_SPEED_KEYS},
                  derived=_download_derived))

# Every stage-2 and semantic task but the reading ones is numpy on one core. No task waits
# on another, so these cannot deadlock even a 1-CPU Ray instance.
WAVE_TASK_CPUS = 1
READ_CPUS = 0.5

DEDUP = StageContract(
    "dedup", sections=("dedup", "output", "ray"),
    inputs=(StageInput(RAW_FOLDER, "download", _when_dedup), StageInput("dedup.index")),
    outputs=(DEDUP_FOLDER,),
    resources=Resources(task_cpus=WAVE_TASK_CPUS, read_cpus=READ_CPUS),
    # semantic dedup is stage 3's pass: its settings do not make this stage stale
    digest=Digest({"dedup": ("semantic",)}, inputs=("raw parquet files", "dedup.index files")))

SEMANTIC = StageContract(
    "semantic", sections=("dedup.semantic", "output", "ray"),
    # made by stage 3's scoring pass and stage 2, within the same `process` run
    inputs=(StageInput(SCORES_FOLDER), StageInput(EMBEDDINGS_FOLDER),
            StageInput(DEDUP_FOLDER)),
    outputs=(DEDUP_FOLDER,),
    resources=Resources(task_cpus=WAVE_TASK_CPUS, read_cpus=READ_CPUS),
    digest=Digest({"dedup.semantic": ()},
                  inputs=("stage 3's settings digest", "the score cut", "embedding files")))

# Stage 3: CPUs left free of actors for the reading, filtering and writing tasks. Actors
# hold their CPUs for the whole run: if pools took every CPU, no task could run and the
# stage would hang (Ray's default of one CPU per actor does exactly that on a small
# machine).
TASK_CPU_RESERVE = 0.75
TASK_CPUS = 0.25  # each task of stage 3: reading a raw shard, a plain step, writing

PROCESS = StageContract(
    "process", sections=("process", "dedup", "output", "ray"),
    inputs=(StageInput(RAW_FOLDER, "download", _always),
            StageInput(DEDUP_FOLDER, "dedup", _when_dedup),
            StageInput(SCORES_FOLDER), StageInput(EMBEDDINGS_FOLDER)),  # its own caches
    outputs=(SHARDS_FOLDER, SCORES_FOLDER, EMBEDDINGS_FOLDER), output_files=(MANIFEST,),
    resources=Resources(task_cpus=TASK_CPUS, pools=True, cpu_reserve=TASK_CPU_RESERVE),
    # the dedup decisions; the writer's task labels
    # (process.decode.where moves work, never bytes; its device changes the pixels)
    digest=Digest({"dedup": (), "process.tasks": (), "process.decode": ("where",)},
                  steps=True))

CONTRACTS = {c.name: c for c in (DOWNLOAD, DEDUP, SEMANTIC, PROCESS)}


def shard_config(cfg: PairforgeConfig) -> ShardConfig:
    """What stage 1's shard tasks (and ``--retry-failed``'s) are handed."""
    return ShardConfig(cfg.input, cfg.download, cfg.output, recaption_first(cfg))


def step_config(cfg: PairforgeConfig) -> StepConfig:
    """What stage 3's steps are handed: the process section, and each setting of another
    part a step reads (the recaption cache's default folder under OUT; whether stage 2
    dropped exact copies; whether the semantic pass reads CLIP's embeddings)."""
    return StepConfig(cfg.process, cfg.output, exact_dedup=cfg.dedup.enabled,
                      semantic_dedup=cfg.dedup.semantic.enabled)


def with_step_config(cfg: PairforgeConfig, steps: StepConfig) -> PairforgeConfig:
    """The whole config with the process section a step's pass runs under (a scoring
    pass's, or what a ``ScoringStep`` learned for the writing pass)."""
    return cfg.model_copy(update={"process": steps.process})
