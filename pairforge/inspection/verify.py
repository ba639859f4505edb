"""`pairforge verify`: re-read every training tar and check it against the manifest."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from typing import Any

import numpy as np

from pairforge.shards.storage import MANIFEST, SHARDS_FOLDER, OutputDir
from pairforge.shards.tar import split_member_name

REQUIRED = ("txt", "json")
IMAGE_EXTS = ("jpg", "webp", "png")


def _read_samples(out: OutputDir, name: str) -> tuple[dict[str, dict[str, bytes]], list[str]]:
    """key -> {extension: bytes} of one tar, and problems reading it (truncation...)."""
    samples: dict[str, dict[str, bytes]] = {}
    problems = []
    try:
        with out.fs.open(out.path(SHARDS_FOLDER, name), "rb") as f, \
                tarfile.open(fileobj=f, mode="r|") as tar:
            for info in tar:
                key, ext = split_member_name(info.name)
                if key is None:
                    problems.append(f"{name}: member {info.name} is not named KEY.EXT")
                    continue
                if ext in samples.get(key, {}):
                    problems.append(f"{name}: {key}.{ext} appears twice")
                samples.setdefault(key, {})[ext] = tar.extractfile(info).read()
    except (tarfile.TarError, OSError, EOFError) as err:
        problems.append(f"{name}: cannot be read to the end ({err})")
    return samples, problems


def _check_sample(name: str, key: str, files: dict[str, bytes],
                  tokenized: bool) -> tuple[dict[str, Any] | None, list[str]]:
    missing = [e for e in REQUIRED if e not in files]
    if not any(e in files for e in IMAGE_EXTS):
        missing.append("image")
    if tokenized:
        missing += [e for e in ("vq.npy", "tok.npy") if e not in files]
    if missing:
        return None, [f"{name}: sample {key} lacks {', '.join(missing)}"]
    meta = json.loads(files["json"])
    problems = []
    if tokenized:
        codes = np.load(io.BytesIO(files["vq.npy"]))
        caption = np.load(io.BytesIO(files["tok.npy"]))
        if list(codes.shape) != meta.get("token_grid") or codes.size != meta.get(
                "n_image_tokens"):
            problems.append(f"{name}: sample {key} vq.npy shape {codes.shape} disagrees with "
                            f"its json ({meta.get('token_grid')}, {meta.get('n_image_tokens')})")
        if caption.size != meta.get("n_caption_tokens"):
            problems.append(f"{name}: sample {key} tok.npy has {caption.size} tokens, json says "
                            f"{meta.get('n_caption_tokens')}")
        meta = {**meta, "n_image_tokens": int(codes.size), "n_caption_tokens": int(caption.size)}
    return meta, problems


def _shard_totals(metas: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    totals: dict[str, Counter] = {}
    for meta in metas:
        task = meta.get("task")
        t = totals.setdefault(task, Counter())
        caption = meta["n_caption_tokens"] if task != "img" else 0
        t.update(samples=1, image_tokens=meta["n_image_tokens"], caption_tokens=caption,
                 sequence_tokens=meta["n_image_tokens"] + caption + 4)
    return {task: dict(c) for task, c in totals.items()}


def verify_dataset(path: str, storage_options: dict | None = None,
                   tolerance_images: float = 1.0) -> list[str]:
    """Every problem found; an empty list means the dataset matches its manifest."""
    out = OutputDir(path, storage_options)
    if not out.exists(MANIFEST):
        return [f"{path}: no manifest.json (not a finished pairforge dataset)"]
    manifest = out.read_json(MANIFEST)
    tokenized = manifest.get("vocab") is not None
    problems: list[str] = []
    seen: set[str] = set()
    all_metas = []
    for shard in manifest["shards"]:
        name = shard["name"]
        samples, read_problems = _read_samples(out, name)
        problems += read_problems
        problems += _check_settings(out, shard)
        if len(samples) != shard["samples"]:
            problems.append(f"{name}: {len(samples)} samples, manifest says {shard['samples']}")
        metas = []
        for key, files in samples.items():
            if key in seen:
                problems.append(f"{name}: key {key} also appears in an earlier shard")
            seen.add(key)
            meta, sample_problems = _check_sample(name, key, files, tokenized)
            problems += sample_problems
            if meta is not None:
                metas.append(meta)
        if tokenized:
            problems += _compare_totals(name, _shard_totals(metas), shard.get("tasks", {}))
        all_metas += metas
    if tokenized:
        problems += _check_budget(manifest, all_metas, tolerance_images)
    return problems


def _check_settings(out: OutputDir, shard: dict[str, Any]) -> list[str]:
    """The shard's stats file still records the settings the manifest says it was made
    under (a rerun that redid it without rebuilding the manifest would differ)."""
    name = shard["name"]
    stats_file = name.replace(".tar", "_stats.json")
    if "settings_digest" not in shard or not out.exists(SHARDS_FOLDER, stats_file):
        return []
    recorded = (out.read_json(SHARDS_FOLDER, stats_file).get("settings") or {}).get("digest")
    if recorded != shard["settings_digest"]:
        return [f"{name}: made under settings {recorded}, manifest says "
                f"{shard['settings_digest']}"]
    return []


def _compare_totals(name: str, found: dict, expected: dict) -> list[str]:
    problems = []
    for task in sorted(set(found) | set(expected)):
        for field in ("samples", "image_tokens", "caption_tokens", "sequence_tokens"):
            got, want = found.get(task, {}).get(field, 0), expected.get(task, {}).get(field, 0)
            if got != want:
                problems.append(f"{name}: {task} {field} is {got}, manifest says {want}")
    return problems


def _check_budget(manifest: dict, metas: list[dict], tolerance_images: float) -> list[str]:
    total = sum(m["n_image_tokens"] for m in metas)
    if not total:
        return []
    unconditional = sum(m["n_image_tokens"] for m in metas if m.get("task") in ("i2t", "img"))
    target = manifest["budget"]["target_unconditional_share"]
    largest = max(m["n_image_tokens"] for m in metas)
    allowed = tolerance_images * largest * max(1, len(manifest["shards"])) / total
    realized = unconditional / total
    problems = []
    if abs(realized - target) > allowed and target >= _img_share(metas, total):
        problems.append(f"budget: unconditional image-token share {realized:.4f} is off the "
                        f"target {target} by more than {allowed:.4f}")
    stated = manifest["budget"]["realized_unconditional_share"]
    if stated is not None and abs(stated - realized) > 1e-9:
        problems.append(f"budget: manifest states share {stated:.6f}, the tars give "
                        f"{realized:.6f}")
    return problems


def _img_share(metas: list[dict], total: int) -> float:
    return sum(m["n_image_tokens"] for m in metas if m.get("task") == "img") / total
