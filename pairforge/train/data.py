"""Training data: datasets checked against the model's vocabulary, streamed with webdataset.

Only ``KEY.json``, ``KEY.vq.npy`` and ``KEY.tok.npy`` are read from each sample (images are
never decoded). The stream is a pure function of (shards, seed, rank), so a resumed run
rebuilds it and skips the batches it already trained on: the data position is a count.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import fsspec
import numpy as np
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander

from pairforge.shards.labels import I2T, IMG, T2I
from pairforge.shards.storage import MANIFEST, SHARDS_FOLDER, OutputDir
from pairforge.tokenizers.vocab import VocabLayout, VocabMismatch
from pairforge.train.config import DataConfig
from pairforge.train.sequences import Batch, Sequence, build_sequence, collate

WANTED = (".json", ".vq.npy", ".tok.npy")
UNCONDITIONAL = (I2T, IMG)  # the first stage of the staged schedule


@dataclass(frozen=True)
class Shard:
    url: str
    name: str
    dataset: str
    tasks: dict[str, dict[str, int]]  # the manifest's per-task totals for this shard


@dataclass
class Datasets:
    """The datasets' manifests and layouts, and the train/held-out shard split."""

    layouts: dict[str, VocabLayout]
    manifests: dict[str, dict[str, Any]]
    train: list[Shard] = field(default_factory=list)
    heldout: list[Shard] = field(default_factory=list)


def _read_manifest(path: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    try:
        return OutputDir(path, storage_options).read_json(MANIFEST)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} has no manifest.json: build it with `pairforge build` "
                                "(only shards a manifest lists are complete)") from None


def _layout(manifest: dict[str, Any], where: str) -> VocabLayout:
    if not manifest.get("vocab"):
        raise VocabMismatch(f"{where}: the shards carry no tokens (process.tokenize was off), "
                            "so there is nothing to train on")
    return VocabLayout.from_manifest(manifest["vocab"])


def open_datasets(cfg: DataConfig) -> Datasets:
    paths = [cfg.path] if isinstance(cfg.path, str) else list(cfg.path)
    found = Datasets({}, {})
    for path in paths:
        manifest = _read_manifest(path, cfg.storage_options)
        found.manifests[path] = manifest
        found.layouts[path] = _layout(manifest, path)
    _split(found, paths, cfg)
    return found


def _split(found: Datasets, paths: list[str], cfg: DataConfig) -> None:
    shards = [Shard(OutputDir(p, cfg.storage_options).uri(SHARDS_FOLDER, s["name"]), s["name"], p,
                    s.get("tasks", {})) for p in paths for s in found.manifests[p]["shards"]]
    first = [s for s in shards if s.dataset == paths[0]]
    if isinstance(cfg.heldout_shards, int):
        held = first[len(first) - cfg.heldout_shards:] if cfg.heldout_shards else []
    else:
        held = [s for s in first if s.name in set(cfg.heldout_shards)]
        missing = set(cfg.heldout_shards) - {s.name for s in held}
        if missing:
            raise ValueError(f"data.heldout_shards names shards the manifest does not list: "
                             f"{sorted(missing)}")
    found.heldout = held
    found.train = [s for s in shards if s not in held]
    if not found.train:
        raise ValueError("no training shards left after holding out data.heldout_shards")


def model_layout(spec: str | dict[str, Any] | None, datasets: Datasets,
                 storage_options: dict[str, Any] | None = None) -> VocabLayout:
    """The vocabulary the model is built for (model.vocab), checked against every dataset."""
    if spec is None:
        layout = next(iter(datasets.layouts.values()))
    elif isinstance(spec, dict):
        layout = VocabLayout.from_manifest(spec.get("vocab", spec))
    else:
        layout = _layout_from_path(spec, storage_options or {})
    for path, theirs in datasets.layouts.items():
        layout.check_compatible(theirs, "model", f"shards in {path}")
    return layout


def _layout_from_path(spec: str, storage_options: dict[str, Any]) -> VocabLayout:
    if spec.endswith(".json"):
        with fsspec.open(spec, "r", **storage_options) as f:
            data = json.load(f)
        return VocabLayout.from_manifest(data.get("vocab", data))
    return _layout(_read_manifest(spec, storage_options), spec)


def task_totals(shards: Iterable[Shard]) -> dict[str, dict[str, int]]:
    """The manifest's samples and image/caption tokens per task over these shards."""
    totals: dict[str, dict[str, int]] = {}
    for shard in shards:
        for task, counts in shard.tasks.items():
            t = totals.setdefault(task, {})
            for k, v in counts.items():
                t[k] = t.get(k, 0) + v
    return dict(sorted(totals.items()))


# ---------------------------------------------------------------------------- reading
def _open(urls: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    # fsspec rather than webdataset's gopen, so any fsspec URL (s3://, gs://) streams too
    for item in urls:
        with fsspec.open(item["url"], "rb") as stream:
            yield {"url": item["url"], "stream": stream}


def read_samples(urls: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Token fields of each sample: key, label, image codes, caption ids."""
    files = tar_file_expander(_open(urls), select_files=lambda name: name.endswith(WANTED))
    for raw in group_by_keys(files):
        meta = json.loads(raw["json"])
        if "vq.npy" not in raw or meta.get("task") is None:
            raise ValueError(f"{raw['__url__']}: sample {raw['__key__']} has no image tokens")
        yield {"key": raw["__key__"], "label": meta["task"],
               "codes": np.load(io.BytesIO(raw["vq.npy"])),
               "caption": np.load(io.BytesIO(raw["tok.npy"])) if "tok.npy" in raw
               else np.zeros(0, np.int32)}


def shard_stream(urls: list[str], cfg: DataConfig, seed: int, rank: int, world: int,
                 resampled: bool) -> Iterator[dict[str, Any]]:
    """Shard URLs in training order: resampled per rank (endless), or shuffled epochs."""
    if resampled:
        # webdataset seeds each rank's draw with (rank, epoch, seed): reproducible streams
        yield from wds.ResampledShards(urls, seed=seed, worker_seed=lambda: rank,
                                       deterministic=True, empty_check=False)
        return
    mine = urls[rank::world]
    if not mine:
        raise ValueError(f"{len(urls)} training shards cannot feed {world} processes without "
                         "data.resampled")
    epochs = range(cfg.epochs) if cfg.epochs else count()
    for epoch in epochs:
        order = seed * 100_003 + epoch if cfg.shuffle_shards else None
        yield from wds.SimpleShardList(mine, seed=order)


def bucket(sequences: Iterator[Sequence], batch_size: int, bucket_batches: int,
           rng: random.Random) -> Iterator[list[Sequence]]:
    """Batches of similar lengths: sort a buffer of ``bucket_batches`` batches by length,
    cut it into batches, emit them in shuffled order. The last batch of a finite stream may
    be short; every other batch is full."""
    size = batch_size * bucket_batches
    pending: list[Sequence] = []
    for seq in sequences:
        pending.append(seq)
        if len(pending) == size:
            yield from _cut(pending, batch_size, rng)
            pending = []
    if pending:
        yield from _cut(pending, batch_size, rng)


def _cut(pending: list[Sequence], batch_size: int, rng: random.Random) -> list[list[Sequence]]:
    ordered = sorted(pending, key=lambda s: len(s.tokens))
    batches = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    rng.shuffle(batches)
    return batches


@dataclass
class StreamSpec:
    """Everything a training stream depends on; the same spec gives the same batches."""

    urls: list[str]
    data: DataConfig
    layout: VocabLayout
    recipe: str
    batch_size: int
    seed: int
    rank: int = 0
    world: int = 1
    resampled: bool = False
    labels: tuple[str, ...] = (T2I, I2T, IMG)  # the staged schedule streams a subset


def train_batches(spec: StreamSpec) -> Iterator[Batch]:
    samples = read_samples(shard_stream(spec.urls, spec.data, spec.seed, spec.rank, spec.world,
                                        spec.resampled))
    samples = (s for s in samples if s["label"] in spec.labels)
    if spec.data.shuffle_buffer:
        rng = random.Random(f"shuffle:{spec.seed}:{spec.rank}")
        samples = wds.shuffle(bufsize=spec.data.shuffle_buffer,
                              initial=spec.data.shuffle_buffer, rng=rng)(samples)
    sequences = (build_sequence(s["label"], s["caption"], s["codes"], spec.layout, spec.recipe)
                 for s in samples)
    rng = random.Random(f"bucket:{spec.seed}:{spec.rank}")
    for group in bucket(sequences, spec.batch_size, spec.data.bucket_batches, rng):
        yield collate(group, spec.layout.pad)


class PositionedStream:
    """An iterator of batches that knows how many it has handed out (the data position)."""

    def __init__(self, make: Callable[[], Iterator[Batch]], position: int = 0) -> None:
        self._it = make()
        self.position = 0
        for _ in range(position):  # resume: replay the stream up to where the run stopped
            next(self._it)
            self.position += 1

    def __iter__(self) -> PositionedStream:
        return self

    def __next__(self) -> Batch:
        batch = next(self._it)
        self.position += 1
        return batch


def heldout_sequences(urls: list[str], layout: VocabLayout, rank: int = 0,
                      world: int = 1) -> Iterator[Sequence]:
    """Every held-out captioned sample both ways (t2i and i2t) and img samples once, so
    L_I|T, L_I|0 and L_T|I are measured on the same samples whatever the recipe."""
    for index, s in enumerate(read_samples({"url": u} for u in urls)):
        if index % world != rank:
            continue
        if s["label"] == IMG or not len(s["caption"]):
            yield build_sequence(IMG, s["caption"], s["codes"], layout)
            continue
        for task in (T2I, I2T):
            yield build_sequence(task, s["caption"], s["codes"], layout)


def heldout_batches(urls: list[str], layout: VocabLayout, batch_size: int,
                    max_batches: int | None, rank: int = 0, world: int = 1) -> Iterator[Batch]:
    groups = bucket(heldout_sequences(urls, layout, rank, world), batch_size, 8,
                    random.Random("heldout"))
    for index, group in enumerate(groups):
        if max_batches is not None and index >= max_batches:
            return
        yield collate(group, layout.pad)
