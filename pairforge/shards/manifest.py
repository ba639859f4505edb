"""Dataset-level files: manifest.json (the token budget), sizes.json, index.wids.json.

Everything here is derived from the complete shards' stats files, so the manifest always
describes exactly the shards on disk, however many runs and workers made them.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections import Counter
from typing import Any

from pairforge.config import PairforgeConfig
from pairforge.shards.features import hf_features
from pairforge.shards.raw import shard_name, stats_name
from pairforge.shards.storage import RAW_FOLDER, SHARDS_FOLDER, OutputDir
from pairforge.stage import Step

MANIFEST_VERSION = 1
VERSIONED = ("pairforge", "torch", "open_clip_torch", "transformers", "ray", "webdataset",
             "pillow", "pyarrow")


def _versions() -> dict[str, str | None]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _sum_tasks(shards: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    totals: dict[str, Counter] = {}
    for shard in shards:
        for task, counts in shard.get("tasks", {}).items():
            totals.setdefault(task, Counter()).update(counts)
    return {task: dict(c) for task, c in sorted(totals.items())}


def _sum_recaption(shards: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The shards' recaption stats added up (counters nested one level deep)."""
    parts = [s["recaption"] for s in shards if "recaption" in s]
    if not parts:
        return None
    total: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            if isinstance(value, dict):
                total.setdefault(name, Counter()).update(value)
            else:
                total[name] = total.get(name, 0) + value
    return {k: dict(sorted(v.items())) if isinstance(v, Counter) else v
            for k, v in sorted(total.items())}


def _sum_steps(shards: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each step's rows in and out, rows ended by status and seconds, over all shards."""
    total: dict[str, dict[str, Any]] = {}
    for shard in shards:
        for name, part in shard.get("step_stats", {}).items():
            into = total.setdefault(name, {"rows_in": 0, "rows_out": 0, "ended": Counter(),
                                           "seconds": 0.0})
            into["rows_in"] += part["rows_in"]
            into["rows_out"] += part["rows_out"]
            into["ended"].update(part["ended"])
            into["seconds"] = round(into["seconds"] + part["seconds"], 3)
    for part in total.values():
        part["ended"] = dict(sorted(part["ended"].items()))
    return total


def _funnel(out: OutputDir, shard_ids: list[int], shards: list[dict[str, Any]]) -> dict:
    download: Counter = Counter()
    for shard_id in shard_ids:
        download.update(out.read_json(RAW_FOLDER, stats_name(shard_id))["status"])
    final: Counter = Counter()
    for shard in shards:
        final.update(shard["status"])
    return {"input_rows": sum(download.values()), "download": dict(download),
            "final": dict(final)}


def _one_value(values: set, name: str, default: Any) -> Any:
    """The one value every shard records; shards made under different settings cannot
    share a manifest (reruns refuse to mix them, so this only meets hand-mixed folders)."""
    if len(values) > 1:
        raise ValueError(f"the shards were made with different {name}: {sorted(values)}")
    return values.pop() if values else default


def _vocab(shards: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The vocabulary layout the tokenize step recorded in the shards (all the same)."""
    layouts = {json.dumps(s["vocab"], sort_keys=True) for s in shards if "vocab" in s}
    layout = _one_value(layouts, "vocabulary layouts", None)
    return json.loads(layout) if layout else None


def _step_entries(cfg: PairforgeConfig, steps: list[type[Step]],
                  shards: list[dict[str, Any]]) -> dict[str, Any]:
    """What the steps say of themselves (``Step.manifest_entries``), by section: the models
    they loaded, each classifier with the rows it scored and dropped."""
    sections: dict[str, Any] = {"models": {}, "classifiers": []}
    totals = _sum_steps(shards)
    for step in steps:
        for section, entry in step.manifest_entries(cfg, shards,
                                                    totals.get(step.name, {})).items():
            if isinstance(entry, list):
                sections.setdefault(section, []).extend(entry)
            else:
                sections.setdefault(section, {}).update(entry)
    return sections


def build_manifest(out: OutputDir, cfg: PairforgeConfig,
                   steps: list[type[Step]]) -> dict[str, Any]:
    """``steps``: every step of the stage, on or off (each says what the manifest records
    of it, e.g. a model that did not run as null)."""
    ids = sorted(int(n.split("_")[0]) for n in out.glob(f"{SHARDS_FOLDER}/*_stats.json"))
    shards = [out.read_json(SHARDS_FOLDER, stats_name(i)) for i in ids]
    tasks = _sum_tasks(shards)
    image_total = sum(t["image_tokens"] for t in tasks.values())
    unconditional = sum(tasks.get(t, {}).get("image_tokens", 0) for t in ("i2t", "img"))
    budgets = [s["budget"] for s in shards if "budget" in s]
    p_drop = _one_value({b["p_drop"] for b in budgets}, "p_drop", cfg.process.tasks.p_drop)
    entries = _step_entries(cfg, steps, shards)
    return {
        "manifest_version": MANIFEST_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": _versions(),
        "config": cfg.model_dump(mode="json"),
        "vocab": _vocab(shards),
        **entries,
        "recaption": _sum_recaption(shards),
        "steps": _sum_steps(shards),
        "budget": {
            "p_drop": p_drop,
            "target_unconditional_share": p_drop,
            "realized_unconditional_share": unconditional / image_total if image_total else None,
            "realized_i2t_share": (tasks.get("i2t", {}).get("image_tokens", 0) / image_total
                                   if image_total else None),
            "max_prefix_deviation_tokens": max((b["max_prefix_deviation"] for b in budgets),
                                               default=None),
        },
        "totals": {"samples": sum(s["successes"] for s in shards), "tasks": tasks},
        "shards": [{"name": f"{shard_name(s['shard'])}.tar", "samples": s["successes"],
                    "rows": s["count"], "tasks": s.get("tasks", {}), "budget": s.get("budget"),
                    "settings_digest": (s.get("settings") or {}).get("digest"),
                    "status": s["status"]} for s in shards],
        "funnel": _funnel(out, ids, shards),
    }


def write_dataset_files(out: OutputDir, manifest: dict[str, Any]) -> None:
    """manifest.json, sizes.json (open_clip_train reads it next to the tars, so a copy goes
    into shards/ too) and index.wids.json (wids' shard index, paths relative to OUT)."""
    sizes = {s["name"]: s["samples"] for s in manifest["shards"]}
    out.write_json(sizes, "sizes.json")
    out.write_json(sizes, SHARDS_FOLDER, "sizes.json")
    out.write_json({"__kind__": "wids-shard-index-v1", "wids_version": 1,
                    "name": "pairforge", "shardlist": [
                        {"url": f"{SHARDS_FOLDER}/{s['name']}", "nsamples": s["samples"]}
                        for s in manifest["shards"]]}, "index.wids.json")
    image_extension = manifest["config"]["download"]["image"]["encode_format"]
    classifiers = manifest.get("classifiers") or []
    scores = [c["score"] for c in classifiers]
    out.write_json(hf_features(image_extension, manifest["vocab"] is not None, scores),
                   "features.json")
    out.write_json(manifest, "manifest.json")
