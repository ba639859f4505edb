"""Everything a run needs, asked before any work starts.

A build downloads for hours before stage 3 loads its first model, and a model that cannot
load fails inside an actor. So what a stage will need is checked first, without loading
weights or starting Ray, and every problem is named at once with its config key. This
module only asks; each thing checks itself:

* the output folder can be created and written (``shards/output_checks.py``: a probe file,
  written and deleted);
* the input paths exist and the first table has the named columns
  (``download/input_checks.py``), and the dedup index files exist;
* every source an enabled step loads (``Step.requirements``): each kind answers
  ``problems()`` (``sources.py``: a local folder, a cached hub id, an open_clip model, a
  file, a model an OpenAI-compatible server serves);
* a Ray cluster address accepts a connection.

Hub ids are resolved against the cache of the machine that runs the command; on a
cluster the workers need the same cache (or a shared ``HF_HUB_CACHE``).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pairforge.config import ConfigError, PairforgeConfig
from pairforge.download.input_checks import input_problems
from pairforge.pipeline.contract import CONTRACTS, step_config
from pairforge.shards.output_checks import output_problems
from pairforge.sources import ServedModel, error_reason

Stage = Literal["download", "dedup", "process", "build", "serve"]
RAY_CONNECT_TIMEOUT_S = 5.0  # a live cluster accepts at once


def preflight(cfg: PairforgeConfig, stage: Stage) -> None:
    """Raise one ``ConfigError`` listing every problem that would stop ``stage`` later."""
    problems = []
    if stage == "serve":  # the service writes no files and reads no stage's
        problems += serve_model_problems(cfg)
    else:
        if stage in ("download", "build"):
            problems += input_problems(cfg.input)
        # an output folder that cannot be written is not asked for earlier stages' files
        problems += (output_problems(cfg.output.path, cfg.output.storage_options)
                     or earlier_stage_problems(cfg, stage))
    problems += ray_problems(cfg)
    if stage in ("dedup", "build") and cfg.dedup.enabled:
        problems += dedup_index_problems(cfg)
    if stage in ("process", "build"):
        problems += model_problems(cfg)
    if problems:
        raise ConfigError(f"{stage} cannot start:\n  " + "\n  ".join(problems))


def recaption_problems(cfg: PairforgeConfig) -> list[str]:
    """What the recaption step alone needs (``pairforge recaption-eval``): its models, its
    server, its word lists."""
    from pairforge.recaption.step import RecaptionStep

    return [problem for source in RecaptionStep.requirements(step_config(cfg)).sources
            for problem in source.problems()]


def serve_model_problems(cfg: PairforgeConfig) -> list[str]:
    """What ``pairforge serve``'s model replicas load: the recaption step's local models
    and word lists. Not its captioning server, which may come up after the service (until
    then requests are answered 503 with Retry-After)."""
    from pairforge.recaption.step import RecaptionStep

    return [problem for source in RecaptionStep.requirements(step_config(cfg)).sources
            if not isinstance(source, ServedModel) for problem in source.problems()]


def check_model_sources(cfg: PairforgeConfig) -> None:
    """Raise ``ConfigError`` naming each config key whose model cannot be found (on disk:
    the servers were asked by preflight)."""
    problems = model_problems(cfg, served=False)
    if problems:
        raise ConfigError("a model cannot be found:\n  " + "\n  ".join(problems))


# -- files and folders ---------------------------------------------------------------------

def earlier_stage_problems(cfg: PairforgeConfig, stage: Stage) -> list[str]:
    """A stage run on its own needs the output of the stages before it: each input its
    contract says an earlier stage makes and it cannot start without, first missing first."""
    from pairforge.shards.storage import OutputDir

    contract = CONTRACTS.get(stage)
    if contract is None:
        return []
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    for needed in contract.inputs:
        wanted = needed.made_by and needed.needed and needed.needed(cfg)
        if wanted and not _finished(out, needed.name):
            return [f"output.path: {cfg.output.path} has no {_WHAT[needed.name]}: run "
                    f"`pairforge {needed.made_by}` {_HOW[needed.name]}"]
    return []


# what an earlier stage's finished output is, said to a user who has not run it
_WHAT = {"raw": "complete raw shards", "dedup": "finished dedup"}
_HOW = {"raw": "(or `pairforge build`) first", "dedup": "first, or set dedup.enabled=false"}


def _finished(out: Any, name: str) -> bool:
    """Whether an earlier stage's output under OUT (an ``OutputDir``) is complete."""
    from pairforge.shards.raw import completed_shards
    from pairforge.shards.storage import DEDUP_FOLDER, RAW_FOLDER

    if name == RAW_FOLDER:
        return bool(completed_shards(out, RAW_FOLDER))
    if name == DEDUP_FOLDER:
        return out.exists(DEDUP_FOLDER, "dedup_stats.json")
    raise ValueError(f"no rule says when {name!r} is finished")


def dedup_index_problems(cfg: PairforgeConfig) -> list[str]:
    from pairforge.dedup.index import index_files as _index_files

    problems = []
    for pattern in cfg.dedup.index:
        try:
            _index_files([pattern], cfg.output.storage_options)
        except FileNotFoundError:
            problems.append(f"dedup.index: {pattern} matches no file")
        except Exception as err:  # noqa: BLE001
            problems.append(f"dedup.index: cannot list {pattern} ({error_reason(err)})")
    return problems


# -- what the steps load ------------------------------------------------------------------

def model_problems(cfg: PairforgeConfig, served: bool = True) -> list[str]:
    """Every source the enabled steps load (``Step.requirements``), each checked once by
    its kind; ``served``: also ask the servers of served models."""
    from pairforge.pipeline.chain import enabled_steps

    handed = step_config(cfg)
    sources = dict.fromkeys(source for step in enabled_steps(cfg)
                            for source in step.requirements(handed).sources)
    return [problem for source in sources if served or not isinstance(source, ServedModel)
            for problem in source.problems()]


# -- services ------------------------------------------------------------------------------

def ray_problems(cfg: PairforgeConfig) -> list[str]:
    """A cluster address must accept a connection: ray.init waits minutes on one that
    does not, silently."""
    import socket

    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    host, _, port = (address or "").split("://")[-1].rpartition(":")
    if not host or not port.isdigit():  # unset, "auto", "local": nothing to reach
        return []
    key = "ray.address" if cfg.ray.address else "RAY_ADDRESS"
    try:
        socket.create_connection((host.strip("[]"), int(port)),
                                 timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as err:
        return [f"{key}: nothing answers at {address} ({error_reason(err)}); start the cluster "
                "(`ray start --head`) or correct the address"]
    return []
