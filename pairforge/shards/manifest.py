"""Dataset-level files: manifest.json (the token budget), sizes.json, index.wids.json.

Everything here is derived from the complete shards' stats files, so the manifest always
describes exactly the shards on disk, however many runs and workers made them. The stats
files are folded in one at a time, in shard order (read a batch at once, concurrently on
object stores), so the driver holds counters and two small numbers a shard, never the
shards' stats: each shard's manifest entry goes to a temporary file as the fold goes, and
the files are written from it streaming, with the bytes ``OutputDir.write_json`` would
write for the whole content.
"""

from __future__ import annotations

import bisect
import heapq
import importlib.metadata
import json
import os
import re
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import IO, Any

import numpy as np

from pairforge.shards.failures import SHOWN, HostFailures
from pairforge.shards.features import hf_features
from pairforge.shards.raw import shard_name, stats_name
from pairforge.shards.storage import RAW_FOLDER, SHARDS_FOLDER, OutputDir
from pairforge.stage import Step, StepConfig

MANIFEST_VERSION = 1
VERSIONED = ("pairforge", "torch", "open_clip_torch", "transformers", "ray", "webdataset",
             "pillow", "pyarrow")
STATS_BATCH = 256  # stats files read at once: bounds memory, and the requests in flight
STATS_FILE = re.compile(r"(\d+)_stats\.json")


def _versions() -> dict[str, str | None]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _dumps(data: Any) -> str:
    """What ``OutputDir.write_json`` writes."""
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def _list_item(data: Any, first: bool) -> bytes:
    """``data`` as an item of a list that is the value of a top-level key (two levels
    deep, so every line of it is indented by four more spaces), with its separator."""
    return (b"" if first else b",") + ("\n" + _dumps(data)).replace("\n", "\n    ").encode()


def _write_with_list(f: IO[bytes], fields: dict[str, Any], key: str,
                     items: Iterable[bytes], empty: bool) -> None:
    """Write ``{**fields, key: [...]}`` byte for byte as ``_dumps`` would, the list's items
    (``_list_item``s, in order) streamed from ``items``; ``empty`` when there are none."""
    marker = f"\n  {json.dumps(key)}: []"
    # json.dumps escapes every newline inside strings, so a line starting with exactly two
    # spaces and a quote holds a top-level key: the split is at the one place of ``key``
    head, tail = _dumps({**fields, key: []}).split(marker)
    f.write(head.encode())
    f.write(marker[:-1].encode())  # up to "[", the list's items follow
    for chunk in items:
        f.write(chunk)
    f.write(("]" if empty else "\n  ]").encode())
    f.write(tail.encode())


class Manifest:
    """manifest.json's content: ``fields``, everything but the per-shard entries, in memory;
    the entries (its "shards" list) in an anonymous temporary file, already as the list's
    text; and each shard's id and samples in compact arrays for sizes.json and
    index.wids.json. Entries are added in shard order; ``with`` it to remove the file."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields
        self.count = 0
        self.ids = array("i")  # 4 bytes each: a million shards take 8 MB in all
        self.samples = array("i")
        # gone when closed, or when the process dies (closed by the Manifest's own ``with``)
        self._entries = tempfile.TemporaryFile()  # noqa: SIM115

    def add_shard(self, shard_id: int, entry: dict[str, Any]) -> None:
        """``entry``: the shard's item of the manifest's "shards" list."""
        self._entries.write(_list_item(entry, first=not self.count))
        self.ids.append(shard_id)
        self.samples.append(entry["samples"])
        self.count += 1

    def write(self, f: IO[bytes]) -> None:
        """manifest.json: ``fields`` with the entries spliced in as "shards"."""
        self._entries.flush()
        self._entries.seek(0)
        _write_with_list(f, self.fields, "shards", _chunks(self._entries), not self.count)

    def close(self) -> None:
        self._entries.close()

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chunks(f: IO[bytes], size: int = 1 << 20) -> Iterator[bytes]:
    while chunk := f.read(size):
        yield chunk


def _sum_into(total: dict[str, Any], part: dict[str, Any]) -> None:
    """Add ``part`` into ``total``: numbers add, mappings of numbers add key by key."""
    for name, value in part.items():
        if isinstance(value, dict):
            total.setdefault(name, Counter()).update(value)
        else:
            total[name] = total.get(name, 0) + value


# Steps whose per-shard stats (Step.finish_shard) the manifest adds up under their name
SUMMED_SECTIONS = ("recaption", "recaption_2", "training_caption")


class _Fold:
    """What the manifest says of all the shards, added up one shard's stats at a time."""

    def __init__(self) -> None:
        self.tasks: dict[str, Counter] = {}
        # the steps' own stats added up (None: no shard recorded the step)
        self.sections: dict[str, dict[str, Any] | None] = dict.fromkeys(SUMMED_SECTIONS)
        self.steps: dict[str, dict[str, Any]] = {}
        self.p_drops: set[float] = set()
        self.max_deviation: float | None = None
        self.samples = 0
        self.vocab_layouts: set[str] = set()
        self.first: dict[str, Any] | None = None  # the first shard's stats
        self.download: Counter = Counter()  # stage 1's statuses (raw stats)
        self.failures = HostFailures()  # stage 1's failed rows by host (bounded)
        self.raw_without_breakdown = 0  # raw shards written before failures_by_host
        self.retried: Counter = Counter()  # download --retry-failed: shards, rows, ok now
        self.final: Counter = Counter()  # the training shards' statuses

    def add(self, shard: dict[str, Any], raw: dict[str, Any]) -> None:
        if self.first is None:
            self.first = shard
        for task, counts in shard.get("tasks", {}).items():
            self.tasks.setdefault(task, Counter()).update(counts)
        for name in SUMMED_SECTIONS:
            if name in shard:
                self.sections[name] = self.sections[name] or {}
                _sum_into(self.sections[name], shard[name])
        self._add_steps(shard.get("step_stats", {}))
        if "budget" in shard:
            budget = shard["budget"]
            self.p_drops.add(budget["p_drop"])
            if self.max_deviation is None or budget["max_prefix_deviation"] > self.max_deviation:
                self.max_deviation = budget["max_prefix_deviation"]
        if "vocab" in shard:
            self.vocab_layouts.add(json.dumps(shard["vocab"], sort_keys=True))
        self.samples += shard["successes"]
        self.download.update(raw["status"])
        if "retried" in raw:
            self.retried.update(shards=1, rows=raw["retried"]["rows"],
                                ok=raw["retried"]["ok"])
        if "failures_by_host" in raw:
            self.failures.add_section(raw["failures_by_host"])
        else:
            self.raw_without_breakdown += 1
        self.final.update(shard["status"])

    def _add_steps(self, step_stats: dict[str, Any]) -> None:
        """Each step's rows in and out, rows ended by status and seconds."""
        for name, part in step_stats.items():
            into = self.steps.setdefault(name, {"rows_in": 0, "rows_out": 0,
                                                "ended": Counter(), "seconds": 0.0})
            into["rows_in"] += part["rows_in"]
            into["rows_out"] += part["rows_out"]
            into["ended"].update(part["ended"])
            into["seconds"] = round(into["seconds"] + part["seconds"], 3)

    def task_totals(self) -> dict[str, dict[str, int]]:
        return {task: dict(c) for task, c in sorted(self.tasks.items())}

    def section_totals(self, name: str) -> dict[str, Any] | None:
        """A step's shard stats added up (counters nested one level deep)."""
        section = self.sections[name]
        if section is None:
            return None
        return {k: dict(sorted(v.items())) if isinstance(v, Counter) else v
                for k, v in sorted(section.items())}

    def step_totals(self) -> dict[str, dict[str, Any]]:
        return {name: {**part, "ended": dict(sorted(part["ended"].items()))}
                for name, part in self.steps.items()}

    def vocab(self) -> dict[str, Any] | None:
        """The vocabulary layout the tokenize step recorded in the shards (all the same)."""
        layout = _one_value(self.vocab_layouts, "vocabulary layouts", None)
        return json.loads(layout) if layout else None

    def failures_by_host(self) -> dict[str, Any]:
        return {**self.failures.section(SHOWN),
                "shards_without_breakdown": self.raw_without_breakdown}

    def funnel(self) -> dict[str, Any]:
        return {"input_rows": sum(self.download.values()), "download": dict(self.download),
                "final": dict(self.final)}


def _shard_entry(shard: dict[str, Any]) -> dict[str, Any]:
    return {"name": f"{shard_name(shard['shard'])}.tar", "samples": shard["successes"],
            "rows": shard["count"], "tasks": shard.get("tasks", {}),
            "budget": shard.get("budget"),
            "settings_digest": (shard.get("settings") or {}).get("digest"),
            "status": shard["status"]}


def _one_value(values: set, name: str, default: Any) -> Any:
    """The one value every shard records; shards made under different settings cannot
    share a manifest (reruns refuse to mix them, so this only meets hand-mixed folders)."""
    if len(values) > 1:
        raise ValueError(f"the shards were made with different {name}: {sorted(values)}")
    return values.pop() if values else default


def _step_entries(cfg: StepConfig, steps: list[type[Step]], fold: _Fold
                  ) -> dict[str, Any]:
    """What the steps say of themselves (``Step.manifest_entries``), by section: the models
    they loaded, each classifier with the rows it scored and dropped."""
    sections: dict[str, Any] = {"models": {}, "classifiers": []}
    totals = fold.step_totals()
    for step in steps:
        for section, entry in step.manifest_entries(cfg, fold.first or {},
                                                    totals.get(step.name, {})).items():
            if isinstance(entry, list):
                sections.setdefault(section, []).extend(entry)
            else:
                sections.setdefault(section, {}).update(entry)
    return sections


def stats_ids(out: OutputDir, folder: str) -> array:
    """The ids of the shards whose stats file is in ``folder``, ascending. A local folder is
    listed lazily into the array (a list of a million names would be ~100 MB)."""
    ids = array("i")
    if not out.local:
        ids.extend(int(m[1]) for name in out.glob(f"{folder}/*_stats.json")
                   if (m := STATS_FILE.fullmatch(name)))
    elif out.exists(folder):
        with os.scandir(out.path(folder)) as entries:
            for entry in entries:
                if match := STATS_FILE.fullmatch(entry.name):
                    ids.append(int(match[1]))
    if ids:
        np.frombuffer(ids, dtype=np.int32).sort()  # in place
    return ids


def _stats_batches(out: OutputDir, ids: array
                   ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(training shard stats, raw stats) of each shard, in order, a batch read at once
    (``fs.cat`` of many paths runs concurrently on async filesystems: S3, GCS, HTTP)."""
    for start in range(0, len(ids), STATS_BATCH):
        batch = ids[start:start + STATS_BATCH]
        paths = [out.path(folder, stats_name(i)) for i in batch
                 for folder in (SHARDS_FOLDER, RAW_FOLDER)]
        read = out.fs.cat(paths)
        for shard_path, raw_path in zip(paths[::2], paths[1::2], strict=True):
            yield json.loads(read[shard_path]), json.loads(read[raw_path])


def build_manifest(out: OutputDir, config: dict[str, Any], cfg: StepConfig,
                   steps: list[type[Step]]) -> Manifest:
    """``config``: the build's config as the manifest records it; ``cfg``: what the steps
    were handed; ``steps``: every step of the stage, on or off (each says what the manifest
    records of it, e.g. a model that did not run as null)."""
    manifest = Manifest({})
    try:
        _fill(manifest, out, config, cfg, steps)
    except BaseException:
        manifest.close()
        raise
    return manifest


def _fill(manifest: Manifest, out: OutputDir, config: dict[str, Any], cfg: StepConfig,
          steps: list[type[Step]]) -> None:
    fold = _Fold()
    for shard, raw in _stats_batches(out, stats_ids(out, SHARDS_FOLDER)):
        fold.add(shard, raw)
        manifest.add_shard(shard["shard"], _shard_entry(shard))
    tasks = fold.task_totals()
    image_total = sum(t["image_tokens"] for t in tasks.values())
    unconditional = sum(tasks.get(t, {}).get("image_tokens", 0) for t in ("i2t", "img"))
    p_drop = _one_value(fold.p_drops, "p_drop", cfg.process.tasks.p_drop)
    manifest.fields.update({
        "manifest_version": MANIFEST_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": _versions(),
        "config": config,
        "vocab": fold.vocab(),
        **_step_entries(cfg, steps, fold),
        "recaption": fold.section_totals("recaption"),
        "recaption_2": fold.section_totals("recaption_2"),
        # which caption trained how many samples
        "training_caption": fold.section_totals("training_caption"),
        "steps": fold.step_totals(),
        "budget": {
            "p_drop": p_drop,
            "target_unconditional_share": p_drop,
            "realized_unconditional_share": unconditional / image_total if image_total else None,
            "realized_i2t_share": (tasks.get("i2t", {}).get("image_tokens", 0) / image_total
                                   if image_total else None),
            "max_prefix_deviation_tokens": fold.max_deviation,
        },
        "totals": {"samples": fold.samples, "tasks": tasks},
        "funnel": fold.funnel(),
        # the hosts that lost the most rows in stage 1 (shards/failures.py)
        "failures_by_host": fold.failures_by_host(),
        # rows fetched again by download --retry-failed, and how many of them are ok now
        "retried": {k: fold.retried[k] for k in ("shards", "rows", "ok")},
    })


def _by_name(ids: array) -> Iterator[int]:
    """The indexes of ``ids`` in the order sort_keys writes their shards' names: as text, so
    an id of more than five digits sorts among the others ("100000.tar" before
    "10001.tar"). The ids of one length are in that order already (they are ascending), so
    the runs of each length are merged, holding nothing."""
    starts = [0, *(bisect.bisect_left(ids, 10 ** digits)
                   for digits in range(5, len(str(max(ids, default=0)))))]
    runs = [range(a, b) for a, b in zip(starts, [*starts[1:], len(ids)], strict=True)]
    return heapq.merge(*runs, key=lambda n: shard_name(ids[n]))


def _sizes_items(manifest: Manifest) -> Iterator[bytes]:
    """sizes.json's body: ``"NAME.tar": samples`` by name."""
    for n, index in enumerate(_by_name(manifest.ids)):
        name = json.dumps(f"{shard_name(manifest.ids[index])}.tar")
        yield f'{"," if n else ""}\n  {name}: {manifest.samples[index]}'.encode()


def _wids_items(manifest: Manifest) -> Iterator[bytes]:
    for n, (shard_id, samples) in enumerate(zip(manifest.ids, manifest.samples, strict=True)):
        yield _list_item({"url": f"{SHARDS_FOLDER}/{shard_name(shard_id)}.tar",
                          "nsamples": samples}, first=not n)


def write_dataset_files(out: OutputDir, manifest: Manifest) -> None:
    """manifest.json, sizes.json (open_clip_train reads it next to the tars, so a copy goes
    into shards/ too), index.wids.json (wids' shard index, paths relative to OUT) and
    features.json. Each appears whole, and manifest.json last."""
    for parts in (("sizes.json",), (SHARDS_FOLDER, "sizes.json")):
        with out.open_atomic(*parts) as f:
            f.write(b"{")
            for chunk in _sizes_items(manifest):
                f.write(chunk)
            f.write(b"}" if not manifest.count else b"\n}")
    with out.open_atomic("index.wids.json") as f:
        _write_with_list(f, {"__kind__": "wids-shard-index-v1", "wids_version": 1,
                             "name": "pairforge"}, "shardlist", _wids_items(manifest),
                         not manifest.count)
    fields = manifest.fields
    image_extension = fields["config"]["download"]["image"]["encode_format"]
    scores = [c["score"] for c in fields.get("classifiers") or []]
    out.write_json(hf_features(image_extension, fields["vocab"] is not None, scores),
                   "features.json")
    with out.open_atomic("manifest.json") as f:
        manifest.write(f)
