"""Everything a run needs, looked up before any work starts.

A build downloads for hours before stage 3 loads its first model, and a model that cannot
load fails inside an actor. So what a stage will need is checked first, without loading
weights or starting Ray, and every problem is named at once with its config key:

* the output folder can be created and written (a probe file, written and deleted);
* the input paths and dedup index files exist;
* every source an enabled step loads (``Step.requirements``; one check per kind): a local
  folder holds the files its loader reads; an open_clip name and pretrained tag are ones
  open_clip knows, or a file; a hub id is in the local Hugging Face cache (looked up on
  disk, never over the network: build machines are often offline); a file exists; an
  OpenAI-compatible server answers ``GET /models`` and serves the model. A step's own
  check then reads what was found (a classifier's labels, a detector's model type).

Hub ids are resolved against the cache of the machine that runs the command; on a
cluster the workers need the same cache (or a shared ``HF_HUB_CACHE``).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pairforge.config import ConfigError, PairforgeConfig
from pairforge.stage import (
    ModelFile,
    ModelFolder,
    ModelSource,
    OpenClipModel,
    ServedModel,
    SourceCheck,
)

Stage = Literal["download", "dedup", "process", "build", "serve"]
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
SERVER_TIMEOUT_S = 5.0  # GET /models: a live server answers at once


def preflight(cfg: PairforgeConfig, stage: Stage) -> None:
    """Raise one ``ConfigError`` listing every problem that would stop ``stage`` later."""
    problems = []
    if stage == "serve":  # the service writes no files and reads no stage's
        problems += serve_model_problems(cfg)
    else:
        if stage in ("download", "build"):
            problems += input_problems(cfg)
        # an output folder that cannot be written is not asked for earlier stages' files
        problems += output_problems(cfg) or earlier_stage_problems(cfg, stage)
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

    return [problem for source in RecaptionStep.requirements(cfg).sources
            for problem in source_problems(source)]


def serve_model_problems(cfg: PairforgeConfig) -> list[str]:
    """What ``pairforge serve``'s model replicas load: the recaption step's local models
    and word lists. Not its captioning server, which may come up after the service (until
    then requests are answered 503 with Retry-After)."""
    from pairforge.recaption.step import RecaptionStep

    return [problem for source in RecaptionStep.requirements(cfg).sources
            if not isinstance(source, ServedModel) for problem in source_problems(source)]


def check_model_sources(cfg: PairforgeConfig) -> None:
    """Raise ``ConfigError`` naming each config key whose model cannot be found (on disk:
    the servers were asked by preflight)."""
    problems = model_problems(cfg, served=False)
    if problems:
        raise ConfigError("a model cannot be found:\n  " + "\n  ".join(problems))


def _reason(err: BaseException) -> str:
    """A short cause: an OSError's text and path, else the exception's own message."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return f"{type(err).__name__}: {err}"


# -- files and folders ---------------------------------------------------------------------

def input_problems(cfg: PairforgeConfig) -> list[str]:
    """The input paths exist, their format is known, and the first table file has the
    named columns (its header only: the whole input is read once, by the download)."""
    from pairforge.download.inputs import BUNDLED_SAMPLE, _expand_paths
    from pairforge.tables import detect_format

    if cfg.input.path == BUNDLED_SAMPLE:
        return []
    def format_of(fs, path: str) -> str:  # noqa: ANN001 - as inputs._plan_one decides it
        if cfg.input.format != "auto" or fs.isdir(path):
            return cfg.input.format
        return detect_format(path)

    try:
        files = [(fs, path, format_of(fs, path)) for fs, path in _expand_paths(cfg.input)]
        return _column_problems(cfg, *files[0]) if files else []
    except ConfigError as err:
        return [str(err)]
    except Exception as err:  # noqa: BLE001 - any filesystem error is the user's to fix
        return [f"input.path: cannot read {cfg.input.path!r} ({_reason(err)})"]


def _column_problems(cfg: PairforgeConfig, fs, path: str, fmt: str) -> list[str]:  # noqa: ANN001
    import csv

    import pyarrow.parquet as pq

    if fmt == "parquet":
        with fs.open(path, "rb") as f:
            columns = pq.read_schema(f).names
    elif fmt in ("csv", "tsv", "jsonl"):
        with fs.open(path, "rt", compression="infer", encoding="utf-8", errors="replace") as f:
            first = f.readline()
        columns = (list(json.loads(first or "{}")) if fmt == "jsonl" else
                   next(csv.reader([first], delimiter="\t" if fmt == "tsv" else ","), []))
    else:
        return []  # folders, tars, txt and json lists: the download reads them whole
    wanted = [cfg.input.url_col, cfg.input.caption_col, *cfg.input.save_additional_columns]
    missing = [c for c in wanted if c and c not in columns]
    if not missing:
        return []
    return [f"input {path!r} has no column {', '.join(repr(m) for m in missing)} (columns: "
            f"{', '.join(columns)}); set input.url_col / input.caption_col / "
            "input.save_additional_columns"]


def output_problems(cfg: PairforgeConfig) -> list[str]:
    """The output folder is created (as the run would) and a probe file written and deleted."""
    from pairforge.shards.storage import OutputDir

    path = cfg.output.path
    created: Path | None = None  # local only: object stores have no folders to undo
    try:
        out = OutputDir(path, cfg.output.storage_options)
        created = _first_missing_folder(out.root) if out.local else None
        out.makedirs()
        probe = out.path(f".pairforge-write-probe-{uuid.uuid4().hex}")
        with out.fs.open(probe, "wb") as f:
            f.write(b"probe")
        out.fs.rm(probe)
    except Exception as err:  # noqa: BLE001 - local, S3, GCS ... each raise their own kind
        hint = _local_hint(path, err) if isinstance(err, OSError) else ""
        return [f"output.path: cannot create or write {path} ({_reason(err)}){hint}"]
    finally:
        if created is not None:
            _remove_empty_folders(Path(out.root), created)
    return []


def _local_hint(path: str, err: OSError) -> str:
    """Which part of a local path is in the way: a file where a folder must be, or a folder
    (such as /proc) that refuses new entries."""
    for folder in Path(path).expanduser().parents:
        if folder.is_file():
            return f": {folder} is a file, not a folder"
        if folder.is_dir():
            refused = isinstance(err, (FileNotFoundError, PermissionError))
            return f": {folder} exists but refuses new folders" if refused else ""
    return ""


def _first_missing_folder(path: str) -> Path | None:
    """The topmost folder of ``path`` that does not exist yet (None: it all exists)."""
    missing = None
    for folder in [Path(path), *Path(path).parents]:
        if folder.exists():
            return missing
        missing = folder
    return missing


def _remove_empty_folders(leaf: Path, top: Path) -> None:
    """Undo the probe's folders, so a run that stops here leaves nothing behind; the run
    makes them again."""
    folder = leaf
    try:
        while True:
            folder.rmdir()  # only ever empty folders: the probe file is gone
            if folder == top:
                return
            folder = folder.parent
    except OSError:
        return


def earlier_stage_problems(cfg: PairforgeConfig, stage: Stage) -> list[str]:
    """A stage run on its own needs the output of the stages before it."""
    from pairforge.shards.raw import completed_shards
    from pairforge.shards.storage import DEDUP_FOLDER, RAW_FOLDER, OutputDir

    if stage not in ("dedup", "process") or (stage == "dedup" and not cfg.dedup.enabled):
        return []
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    if not completed_shards(out, RAW_FOLDER):
        return [f"output.path: {cfg.output.path} has no complete raw shards: run "
                "`pairforge download` (or `pairforge build`) first"]
    if stage == "process" and cfg.dedup.enabled and not out.exists(DEDUP_FOLDER,
                                                                    "dedup_stats.json"):
        return [f"output.path: {cfg.output.path} has no finished dedup: run `pairforge dedup` "
                "first, or set dedup.enabled=false"]
    return []


def dedup_index_problems(cfg: PairforgeConfig) -> list[str]:
    from pairforge.pipeline.dedup_stage import _index_files

    problems = []
    for pattern in cfg.dedup.index:
        try:
            _index_files([pattern], cfg.output.storage_options)
        except FileNotFoundError:
            problems.append(f"dedup.index: {pattern} matches no file")
        except Exception as err:  # noqa: BLE001
            problems.append(f"dedup.index: cannot list {pattern} ({_reason(err)})")
    return problems


# -- what the steps load ------------------------------------------------------------------

def model_problems(cfg: PairforgeConfig, served: bool = True) -> list[str]:
    """Every source the enabled steps load (``Step.requirements``), each checked once by
    its kind; ``served``: also ask the servers of served models."""
    from pairforge.pipeline.chain import enabled_steps

    sources = dict.fromkeys(source for step in enabled_steps(cfg)
                            for source in step.requirements(cfg).sources)
    return [problem for source in sources if served or not isinstance(source, ServedModel)
            for problem in source_problems(source)]


def source_problems(source: ModelSource) -> list[str]:
    """What would stop a step from loading ``source``, looked up on disk only."""
    if isinstance(source, ModelFolder):
        return _folder_problems(source)
    if isinstance(source, OpenClipModel):
        return _open_clip_problems(source)
    if isinstance(source, ModelFile):
        return _file_problems(source)
    return _served_problems(source)


def _folder_problems(source: ModelFolder) -> list[str]:
    """The folder (or cached hub repo) holds one name of every group of ``files``; then
    the source's own check reads its config.json."""
    problems = list(_folder_files_problems(source.key, source.ref, source.files,
                                           source.revision, source.hub))
    if problems or source.check is None:  # a missing local path is no hub id to look up
        return problems
    config = _config_json(source.ref, source.revision)
    return [] if config is None else _checked(source.key, config, source.check)


def _file_problems(source: ModelFile) -> list[str]:
    if not Path(source.path).expanduser().is_file():
        return [f"{source.key}: {source.path} is not a file"]
    return [] if source.check is None else _checked(source.key, source.path, source.check)


def _checked(key: str, path: str, check: SourceCheck) -> list[str]:
    try:
        return check(path)
    except (OSError, ValueError) as err:  # unreadable, or not what it should hold
        return [f"{key}: cannot read {path} ({_reason(err)})"]


def _folder_files_problems(key: str, ref: str, needs: tuple[tuple[str, ...], ...],
                           revision: str | None = None, hub: bool = True) -> Iterator[str]:
    """``needs``: groups of file names; the folder (or cached hub repo) must hold one name of
    every group."""
    folder = Path(ref).expanduser()
    if folder.is_dir():
        for names in needs:
            if not any((folder / name).is_file() for name in names):
                yield f"{key}: {ref} has no {' or '.join(names)}"
    elif not hub:
        yield f"{key}: {ref} is not a folder"
    elif _looks_local(ref):
        yield f"{key}: {ref} is not a folder (and is not a hub id)"
    else:
        missing = [names for names in needs if not _in_hub_cache(ref, names, revision)]
        if missing:
            yield _not_cached(key, ref, revision, missing[0])


def _open_clip_problems(source: OpenClipModel) -> list[str]:
    """The name is one open_clip knows (or in the config path); the weights are a tag of
    it cached from its hub repo, or a file."""
    key = source.key
    if source.model.startswith("hf-hub:"):  # open_clip reads config and weights from the repo
        repo = source.model.removeprefix("hf-hub:")
        return list(_folder_files_problems(f"{key}.model", repo,
                                           (("open_clip_config.json",), OPEN_CLIP_WEIGHTS)))
    import open_clip

    problems, names = [], set(open_clip.list_models())
    if source.model_config_path:
        config = Path(source.model_config_path).expanduser()
        if not config.exists():
            problems.append(f"{key}.model_config_path: {config} does not exist")
        names |= {p.stem for p in ([config] if config.is_file() else config.glob("*.json"))}
    if source.model not in names:
        problems.append(f"{key}.model: {source.model!r} is neither an open_clip model nor "
                        f"in {key}.model_config_path")
    pretrained = source.pretrained
    if pretrained is None or Path(pretrained).expanduser().is_file():
        return problems
    if _looks_local(pretrained) or pretrained.endswith(CHECKPOINT_SUFFIXES):
        problems.append(f"{key}.pretrained: {pretrained} is not a file")
    elif source.model in names and not open_clip.get_pretrained_cfg(source.model, pretrained):
        tags = open_clip.list_pretrained_tags_by_model(source.model)
        problems.append(f"{key}.pretrained: {pretrained!r} is not a tag of {source.model} "
                        f"(open_clip knows {', '.join(tags) or 'none'}) nor a file")
    elif source.model in names:
        problems += _clip_tag_cached(f"{key}.pretrained",
                                     open_clip.get_pretrained_cfg(source.model, pretrained))
    return problems


def _config_json(ref: str, revision: str | None) -> str | None:
    """A model's config.json: in its folder, or in the local hub cache."""
    folder = Path(ref).expanduser()
    if folder.is_dir():
        return str(folder / "config.json")
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(ref, "config.json", revision=revision)
    return found if isinstance(found, str) else None


def _looks_local(ref: str) -> bool:
    """A path, not a hub id: hub ids have at most one slash and no leading dot or tilde."""
    return ref.startswith(("/", ".", "~")) or ref.count("/") > 1


def _in_hub_cache(repo_id: str, names: tuple[str, ...], revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    # a str is a cached file; None (unknown) and _CACHED_NO_EXIST (known absent) are not
    return any(isinstance(try_to_load_from_cache(repo_id, name, revision=revision), str)
               for name in names)


def _not_cached(key: str, repo_id: str, revision: str | None, names: tuple[str, ...],
                instead: str = "a local folder") -> str:
    from huggingface_hub import constants

    at = f" at revision {revision}" if revision else ""
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    return (f"{key}: hub id {repo_id}{at} is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE} has no {' or '.join(names)} of it) and this run does "
            f"not download; fetch it on a machine with network (`{fetch}`) and copy the cache "
            f"here (HF_HUB_CACHE), or set {key} to {instead}")


def _clip_tag_cached(key: str, tag: dict) -> list[str]:
    """open_clip fetches a tag's weights from its hub repo (every tag of open_clip 3 has one;
    a tag with a URL only is left to the loader)."""
    if not tag.get("hf_hub"):
        return []
    repo, filename = os.path.split(tag["hf_hub"])
    names = (filename,) if filename else OPEN_CLIP_WEIGHTS
    if filename.endswith(".bin"):  # open_clip tries the safetensors twin first
        names = (filename.removesuffix(".bin") + ".safetensors", filename)
    if _in_hub_cache(repo, names, None):
        return []
    return [_not_cached(key, repo, None, names, "a checkpoint file")]



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
        socket.create_connection((host.strip("[]"), int(port)), timeout=SERVER_TIMEOUT_S).close()
    except OSError as err:
        return [f"{key}: nothing answers at {address} ({_reason(err)}); start the cluster "
                "(`ray start --head`) or correct the address"]
    return []



def _served_problems(source: ServedModel) -> list[str]:
    """The OpenAI-compatible server answers ``GET {base_url}/models`` and lists the model."""
    import requests

    url = source.base_url.rstrip("/") + "/models"
    key = os.environ.get(source.api_key_env)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = min(SERVER_TIMEOUT_S, source.timeout_s)
    where = f"{source.url_key}: {source.base_url}"
    try:
        response = requests.get(url, headers=headers, timeout=timeout)
    except requests.Timeout:
        return [f"{where}: GET /models got no answer within {timeout:g} s; start the server "
                "or correct the URL"]
    except requests.RequestException as err:
        return [f"{where}: GET /models failed ({_connection_reason(err)}); start the server "
                "or correct the URL"]
    if response.status_code != 200:
        return [f"{where}: GET /models answered HTTP {response.status_code}"
                + (" (check the key in $" + source.api_key_env + ")"
                   if response.status_code in (401, 403) else "")]
    try:
        served = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        return [f"{where}: GET /models did not answer an OpenAI model list"]
    if source.model not in served:
        return [f"{source.key}: {source.model!r} is not served by {source.base_url} "
                f"(it serves {', '.join(repr(m) for m in served) or 'nothing'})"]
    return []


def _connection_reason(err: Exception) -> str:
    # requests wraps the socket error three deep; its "[Errno 111] Connection refused" is
    # the part a person needs
    found = re.search(r"\[Errno -?\d+\] [^'\")]+", str(err))
    return found.group(0).strip() if found else type(err).__name__
