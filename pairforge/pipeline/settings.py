"""The settings that shaped a shard, recorded in its stats file and checked on reruns.

A rerun skips a complete shard only if it was made under the same settings: the config
values that decide the stage's bytes (not how fast they are made: threads, pool and batch
sizes, CPUs, timeouts), the fingerprints of the local model files it loads, and for
stage 3 the settings of the raw shard it was made from. On a difference the run stops
before any work and names the changed keys and the shards affected; ``--redo-changed``
redoes those shards instead, and ``--force`` every shard of the stage. Stage 2 and the
semantic pass, each one output made from all its inputs, use the same digest over their
config section and declared inputs (:func:`inputs_digest`): a finished run is reused while
it matches, else redone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pairforge.config import ConfigError, PairforgeConfig
from pairforge.pipeline.contract import CONTRACTS, section, shared_settings, step_config
from pairforge.pipeline.entry import RunOptions
from pairforge.shards.raw import completed_shards, shard_name, stats_name
from pairforge.shards.storage import (
    EMBEDDINGS_FOLDER,
    RAW_FOLDER,
    SCORES_FOLDER,
    SHARDS_FOLDER,
    OutputDir,
)
from pairforge.stage import setting_values

# The version of what each stage writes for given settings. Bump it with any change that
# makes a stage write other bytes under the same settings (tests/test_golden.py fails on
# such a change), so that reruns redo the shards an older pairforge wrote.
# download 2: libvips downscaling; 3: phash without box pre-reduction, mirror and crop hashes
# download 4: the pixel hash is XXH3-128 (filters/hashing.PIXEL_HASH), not sha256
# process 2: the wider attribute rule and constrained decoding (issue 20)
# process 3: an attribute adjective left without its noun is the person (issue 20)
# download 5: the colour_grid column (a raw shard without it cannot take the colour check)
# download 6: the colour grid is 16x16 of the whole image (the structure check reads it)
# download 7: a resize past max_output_pixels (aspect over 64 at keep_ratio) is too_large
OUTPUT_VERSIONS = {"download": 7, "process": 3}
# Settings added after builds were made, with the value that leaves what an earlier
# pairforge wrote unchanged: recorded only when set otherwise, so that an upgrade does not
# mark every complete shard as made under other settings (and the golden build stays).
ADDED_SETTINGS: dict[str, Any] = {
    # the semantic pass's own inputs digest records them (it reruns when they change)
    "dedup.semantic.max_clusters": 50_000,
    "dedup.semantic.sample_rows": 131_072,
    "dedup.perceptual": True,
    "dedup.mirrors": True,
    "download.opt_out_lists": [],
    "download.block_lists": [],
    # issue 35: a recaption-first build keeps rows without usable alt-text in stage 1 and
    # judges captions after recaptioning in stage 3; clip.score matters only there
    "process.recaption_first": False,
    "process.clip.score": "training",
    "process.recaption.second_prompt": None,
    "process.recaption.input_resolution": None,
    # issue 48: JPEGs decoded on the first model step's GPU
    "process.decode.device": "cpu",
    # the product token of download.user_agent (the header itself, with its version and
    # contact URL, is not a setting): robots.txt groups and X-Robots-Tag match by it
    "download.agent_token": "pairforge",
    # issue 46: the plan's caps (download 7 redoes the shards written before them)
    "download.image.max_decoded_pixels": 33_554_432,
    "download.image.max_output_pixels": None,
}
_SAMPLE_BYTES = 1 << 20  # a model file is fingerprinted by its size and its ends


class SettingsChanged(ConfigError):
    """Complete shards were made under other settings than this run's."""


def file_fingerprint(path: Path) -> str:
    """Names, sizes and the first and last MiB of every file under ``path``: cheap for
    multi-GB weights, and it changes when the weights do."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{size}\0"
                      .encode())
        with open(file, "rb") as f:
            digest.update(f.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                f.seek(size - _SAMPLE_BYTES)
                digest.update(f.read())
    return digest.hexdigest()[:16]


def stage_settings(cfg: PairforgeConfig, stage: str) -> dict[str, Any]:
    """``{dotted key: value}`` of what decides the stage's bytes, model files included
    (without ADDED_SETTINGS at their neutral values)."""
    values = _stage_settings(cfg, stage)
    return {k: v for k, v in values.items()
            if k not in ADDED_SETTINGS or v != ADDED_SETTINGS[k]}


def _stage_settings(cfg: PairforgeConfig, stage: str) -> dict[str, Any]:
    """What the stage's contract (pipeline/contract.py) says its digest covers."""
    digest = CONTRACTS[stage].digest
    values: dict[str, Any] = {"output_version": OUTPUT_VERSIONS[stage],
                              **shared_settings(cfg)}
    for dotted, skip in digest.sections.items():
        values.update(setting_values(section(cfg, dotted), f"{dotted}.", skip))
    if digest.derived:
        values.update(digest.derived(cfg))
    if digest.steps:
        values.update(_step_settings(cfg))
    return values


def _step_settings(cfg: PairforgeConfig) -> dict[str, Any]:
    """Every stage-3 step's settings, on or off, and its local model files' fingerprints."""
    from pairforge.pipeline.chain import stage_steps

    values: dict[str, Any] = {}
    files: dict[str, str | None] = {}
    handed = step_config(cfg)
    for step in stage_steps(cfg):
        needs = step.requirements(handed)
        values.update(needs.settings)
        for source in needs.sources:
            files.update(source.local_files())
    for key, path in files.items():
        if isinstance(path, str) and path and Path(path).exists():
            values[f"{key}#files"] = file_fingerprint(Path(path))
    return values


def settings_digest(values: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def inputs_digest(config: dict[str, Any], **inputs: Any) -> str:
    """The staleness rule of a stage made whole from its inputs (stage 2, the semantic
    pass): the settings digest of its config section and its declared inputs (files by
    name and size, digests of the settings they were made under). A finished run whose
    recorded digest equals this one is reused; any other is redone."""
    return settings_digest({"config": config, **inputs})


def settings_record(values: dict[str, Any]) -> dict[str, Any]:
    """What a shard's stats file keeps: the digest, and the values to name changes by."""
    return {"digest": settings_digest(values), "values": values}


def changed_shards(out: OutputDir, folder: str,
                   expected: dict[int, dict[str, Any]]) -> dict[int, list[str]]:
    """Complete shards in ``folder`` whose recorded settings differ from ``expected``
    (per shard id), with the keys that differ."""
    changed = {}
    for shard_id in sorted(completed_shards(out, folder) & set(expected)):
        recorded = out.read_json(folder, stats_name(shard_id)).get("settings") or {}
        want = expected[shard_id]
        if recorded.get("digest") == settings_digest(want):
            continue
        old = recorded.get("values")
        if old is None:
            changed[shard_id] = ["(settings not recorded)"]  # made by an older pairforge
            continue
        changed[shard_id] = sorted(k for k in set(old) | set(want) if old.get(k) != want.get(k))
    return changed


def _describe(stage: str, folder: str, out: OutputDir, changed: dict[int, list[str]]) -> str:
    keys = sorted({k for ks in changed.values() for k in ks})
    ids = ", ".join(f"{i:05d}" for i in list(changed)[:10])
    more = f" and {len(changed) - 10} more" if len(changed) > 10 else ""
    return (f"{len(changed)} complete {stage} shard(s) in {out.uri(folder)} were made under "
            f"other settings: {ids}{more}. Changed: {', '.join(keys[:12])}"
            f"{' ...' if len(keys) > 12 else ''}.")


Check = tuple[str, str, dict[int, dict[str, Any]]]  # stage, folder, expected per shard id


def check_rerun(out: OutputDir, checks: list[Check], force: bool) -> dict[str, list[int]]:
    """Stop (exit 2) when complete shards were made under other settings, naming the keys
    of every stage in one message; with ``force``, mark them incomplete (their stats files
    go; their cached CLIP scores, made under other settings, go in drop_stale_scores) and
    return their ids per stage."""
    found = [(stage, folder, changed_shards(out, folder, expected))
             for stage, folder, expected in checks]
    found = [f for f in found if f[2]]
    if found and not force:
        raise SettingsChanged(" ".join(_describe(stage, folder, out, changed)
                                       for stage, folder, changed in found)
                              + " Rerun with --redo-changed to redo them (--force redoes "
                              "every shard), or write to another output.path.")
    for _, folder, changed in found:
        for shard_id in changed:
            out.remove(folder, stats_name(shard_id))
    return {stage: sorted(changed) for stage, _, changed in found}


def download_expected(out: OutputDir, cfg: PairforgeConfig) -> dict[int, dict[str, Any]]:
    values = stage_settings(cfg, "download")
    return {shard_id: values for shard_id in completed_shards(out, RAW_FOLDER)}


def process_expected(out: OutputDir, cfg: PairforgeConfig, shard_ids: set[int],
                     raw_digest: str | None = None) -> dict[int, dict[str, Any]]:
    """Per shard id: stage 3's settings plus the settings digest of the raw shard it is
    made from (``raw_digest`` when stage 1 is about to remake them all under it)."""
    values = stage_settings(cfg, "process")
    expected = {}
    for shard_id in shard_ids:
        digest = raw_digest or (out.read_json(RAW_FOLDER, stats_name(shard_id))
                                .get("settings") or {}).get("digest")
        expected[shard_id] = {**values, "raw.settings": digest}
    return expected


SCORES_DIGEST_KEY = b"pairforge.settings"  # a score file's schema metadata


def drop_stale_scores(out: OutputDir, cfg: PairforgeConfig, raw_digest: str | None) -> None:
    """CLIP's scoring pass caches scores (and embeddings) per shard; a rerun reuses them
    only when they were made under this run's stage 3 settings. The rest go (a score file
    is a cache, so no --force is needed), e.g. those of a shard redone under --force, or of
    a run killed after its scoring pass and rerun with another CLIP model."""
    ids = {int(name.split(".")[0]) for name in out.glob(f"{SCORES_FOLDER}/*.parquet")}
    expected = process_expected(out, cfg, ids & completed_shards(out, RAW_FOLDER), raw_digest)
    for shard_id in sorted(ids):
        name = shard_name(shard_id)
        with out.fs.open(out.path(SCORES_FOLDER, f"{name}.parquet"), "rb") as f:
            recorded = (pq.read_schema(f).metadata or {}).get(SCORES_DIGEST_KEY, b"").decode()
        if shard_id in expected and recorded == settings_digest(expected[shard_id]):
            continue
        out.remove(SCORES_FOLDER, f"{name}.parquet")
        out.remove(EMBEDDINGS_FOLDER, f"{name}.npy")
        out.remove(EMBEDDINGS_FOLDER, f"{name}_keys.json")


def check_settings(cfg: PairforgeConfig, stages: tuple[str, ...],
                   run: RunOptions) -> RunOptions:
    """Before any work: every complete shard the stages would skip was made under this
    run's settings, or (``run.force``) it is marked incomplete and redone. All changes of
    all stages are named in one message. Stages this run has checked already
    (``run.checked``) are not read again: returns ``run`` with these stages added, so a run
    that checks every stage up front (``pairforge build``) checks each once."""
    stages = tuple(s for s in stages if s not in run.checked)
    if not stages:
        return run
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    checks: list[Check] = []
    if "download" in stages:
        checks.append(("download", RAW_FOLDER, download_expected(out, cfg)))
    raw_digest = None
    if "process" in stages:
        done = completed_shards(out, SHARDS_FOLDER)
        if "download" in stages:
            # stage 1 runs first and remakes every raw shard it lacks under these settings:
            # a training shard is checked against them even where its raw shard is missing
            # now (a forced stage 1 stopped before redoing it), not skipped unchecked
            raw_digest = settings_digest(stage_settings(cfg, "download"))
        else:
            done &= completed_shards(out, RAW_FOLDER)
        checks.append(("process", SHARDS_FOLDER, process_expected(out, cfg, done, raw_digest)))
    check_rerun(out, checks, run.force)
    if run.redo_all:
        mark_all_incomplete(out, stages)
    if "process" in stages:
        drop_stale_scores(out, cfg, raw_digest)
    return replace(run, checked=run.checked | set(stages))


def mark_all_incomplete(out: OutputDir, stages: tuple[str, ...]) -> None:
    """``--force``: every complete shard of the stages loses its stats file, so the run
    redoes it whole; a redone raw shard's training shard too (it was made from the raw
    shard's old bytes). Cached CLIP scores go with their training shards."""
    folders = {RAW_FOLDER, SHARDS_FOLDER} if "download" in stages else {SHARDS_FOLDER}
    for folder in sorted(folders):
        for shard_id in sorted(completed_shards(out, folder)):
            out.remove(folder, stats_name(shard_id))
    for name in out.glob(f"{SCORES_FOLDER}/*.parquet"):
        shard = name.split(".")[0]
        out.remove(SCORES_FOLDER, name)
        out.remove(EMBEDDINGS_FOLDER, f"{shard}.npy")
        out.remove(EMBEDDINGS_FOLDER, f"{shard}_keys.json")
