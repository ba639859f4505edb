"""The golden build: one small dataset through every stage and step, its bytes pinned.

A refactor must not change what the pipeline writes. ``tests/test_golden.py`` builds this
dataset and compares the digest of every file in it with ``tests/data/golden_digest.json``.
After a change that is meant to change the output, bump the stage's entry in
``pipeline/settings.OUTPUT_VERSIONS`` (so reruns redo shards an older pairforge wrote),
regenerate the fixture and say why in the commit:

    python tests/golden.py --update

The inputs are drawn here (no third-party images) and served over loopback; the models are
the package's shipped captioner and VQ and a tiny open_clip with seeded random weights.
Volatile values (timings, temporary paths, versions of the run's environment) are left out
of the digest; everything a reader of the dataset sees is in it. Floating-point values
(model scores) are pinned apart, to ``FLOAT_TOLERANCE``: torch's CPU kernels differ by
instruction set, so the same build on another processor moves their last bits (every
integer, string and token stays exact).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
DIGEST_FILE = HERE / "data" / "golden_digest.json"
PACKAGE = HERE.parent / "pairforge"
COLOURS = {"red": (200, 40, 40), "blue": (40, 80, 200), "green": (40, 150, 60),
           "yellow": (230, 200, 40)}
SHAPES = ("circle", "square")
TINY_CLIP = {"embed_dim": 32,
             "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8,
                            "head_width": 32},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2,
                          "layers": 2}}
# JSON keys whose values depend on when or where the build ran, not on what it wrote.
# The build runs in one fixed folder on one fixed port: paths and URLs are part of its bytes
# (model fingerprints name their folder, every record keeps its URL).
ROOT = Path(tempfile.gettempdir()) / "pairforge-golden"
PORT = 47391
# consent.fetched: which of a node's concurrent tasks fetches a host's robots.txt first
# (the others read the node's cache) is up to the scheduler.
VOLATILE_KEYS = {"seconds", "rows_per_s", "duration_s", "start_time", "end_time", "created",
                 "pairforge_version", "versions", "log", "fetched", "peak_resident_mib"}
FLOAT_TOLERANCE = 1e-4  # last-bit differences between CPUs are ~1e-7


def draw_scenes(folder: Path, n: int = 30, seed: int = 5) -> list[tuple[str, str]]:
    """``n`` drawn scenes with exact captions, plus an exact copy and a q60 re-encode."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour = rng.choice(list(COLOURS))
        shape = rng.choice(SHAPES)
        width, height = rng.choice([(160, 160), (200, 150), (150, 200)])
        image = Image.new("RGB", (width, height), (128, 128, 128))
        side = rng.randint(50, 90)
        x, y = rng.randint(5, width - side - 5), rng.randint(5, height - side - 5)
        draw = ImageDraw.Draw(image)
        box = (x, y, x + side, y + side)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
        name = f"scene_{i:02d}.jpg"
        image.save(folder / name, quality=90)
        rows.append((name, f"a {colour} {shape} on a grey background"))
    shutil.copy(folder / rows[0][0], folder / "copy.jpg")
    Image.open(folder / rows[1][0]).save(folder / "q60.jpg", quality=60)
    rows += [("copy.jpg", rows[0][1]), ("q60.jpg", rows[1][1])]
    return rows


def tiny_clip(folder: Path, name: str = "pf-golden-clip") -> dict[str, str]:
    """A tiny open_clip with seeded random weights, as a local checkpoint + model config
    registered as ``name`` (the clip section of a config)."""
    import open_clip
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    config = folder / f"{name}.json"
    config.write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    model, _, _ = open_clip.create_model_and_transforms(name)
    torch.save(model.state_dict(), folder / "clip.pt")
    return {"model": name, "pretrained": str(folder / "clip.pt"),
            "model_config_path": str(config)}


def golden_config(input_csv: Path, out: Path, clip: dict[str, str],
                  models: Path = PACKAGE / "sample") -> dict[str, Any]:
    return {
        "input": {"path": str(input_csv), "shard_size": 8},
        "output": {"path": str(out)},
        "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
        "download": {"threads": 4, "allow_addresses": ["127.0.0.1/32"],
                     "image": {"image_size": 64}},
        "process": {
            "basic": {"min_image_side": 48, "min_caption_words": 2},
            "clip": {"enabled": True, "batch_size": 8, "mode": "threshold",
                     "threshold": -1.0, **clip},
            "recaption": {"enabled": True, "model": str(models / "captioner"),
                          "batch_size": 8, "max_new_tokens": 16,
                          "grounding": {"enabled": True, "min_score": 0.0}},
            "tokenize": {"enabled": True,
                         "image": {"backend": "pairforge-vq",
                                   "path_or_id": str(models / "vq32")},
                         "text": {"backend": "bytes"}},
            "tasks": {"p_drop": 0.3},
        },
    }


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold the fixed folder and port for one golden build at a time on this host: two
    checkouts (or a benchmark's worktree and CI) building at once would empty each other's
    folder and fight for the port; the second waits instead."""
    with open(Path(tempfile.gettempdir()) / "pairforge-golden.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(models: Path = PACKAGE / "sample", root: Path = ROOT) -> Path:
    """Run ``pairforge build`` on the golden inputs under ``root`` (emptied); returns OUT."""
    sys.path.insert(0, str(HERE))
    from loopback_server import LoopbackServer

    shutil.rmtree(root, ignore_errors=True)
    # the models are copied under the fixed root: their paths are part of the bytes
    # (settings, cache folder names), and a checkout may be anywhere
    for name in ("captioner", "vq32"):
        shutil.copytree(models / name, root / "models" / name)

    rows = draw_scenes(root / "images")
    clip = tiny_clip(root / "clip")
    with LoopbackServer(root / "images", port=PORT) as server:
        lines = [f"{server.url('/img/' + name)},{caption}" for name, caption in rows]
        lines += [f"{server.url('/status/404')},a page that is gone",
                  f"{server.url('/img/' + rows[2][0])},x"]  # one word: the basic filter
        (root / "in.csv").write_text("url,caption\n" + "\n".join(lines) + "\n")
        cfg = golden_config(root / "in.csv", root / "out", clip, root / "models")
        (root / "golden.yaml").write_text(yaml.safe_dump(cfg))
        done = subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                               str(root / "golden.yaml"), "-q"], capture_output=True,
                              text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"golden build failed:\n{done.stderr[-4000:]}")
    return root / "out"


def _stable_json(value: Any, root: str, floats: list[float]) -> Any:
    """``value`` without volatile keys, ``root`` as ROOT, and each float moved to
    ``floats`` (in key order), None in its place."""
    if isinstance(value, dict):
        return {k: _stable_json(value[k], root, floats) for k in sorted(value)
                if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [_stable_json(v, root, floats) for v in value]
    if isinstance(value, str):
        return value.replace(root, "ROOT")
    if isinstance(value, float):
        floats.append(value)
        return None
    return value


def _json_bytes(data: bytes, root: str, floats: list[float]) -> bytes:
    return json.dumps(_stable_json(json.loads(data), root, floats), sort_keys=True).encode()


def _tar_contents(path: Path, root: str, floats: list[float]) -> bytes:
    """Member names and bytes in order (the headers' mtime says when the shard was written;
    JSON members as ``_json_bytes``)."""
    parts = []
    with tarfile.open(path) as tar:
        for member in tar:
            data = tar.extractfile(member).read()
            if member.name.endswith(".json"):
                data = _json_bytes(data, root, floats)
            parts += [member.name.encode(), data]
    return b"\0".join(parts)


def _parquet_contents(path: Path, root: str, floats: list[float]) -> bytes:
    """The schema and every row (floats moved out, as ``_stable_json``): what a reader
    sees, whatever the writer's encoding and compression."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    schema = table.schema.to_string(show_schema_metadata=False).encode()
    # binary columns (the colour grid) as hex: JSON has no bytes
    rows = json.dumps(table.to_pylist(), default=lambda v: v.hex() if isinstance(v, bytes)
                      else repr(v))
    return schema + b"\0" + _json_bytes(rows.encode(), root, floats)


def digest(out: Path) -> dict[str, dict[str, Any]]:
    """Per file under OUT: sha256 of its contents with volatile keys and floats left out
    (tars by their members, parquet by schema and rows), and its floats in order."""
    root = str(out.parent)
    digests = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        name = str(path.relative_to(out))
        if name.startswith(("logs/", "inputs/")):
            continue  # a run's log says when it ran; inputs/ is the input csv, split
        floats: list[float] = []
        data = path.read_bytes()
        if path.suffix == ".tar":
            data = _tar_contents(path, root, floats)
        elif path.suffix == ".parquet":
            data = _parquet_contents(path, root, floats)
        elif path.suffix == ".json":
            data = _json_bytes(data, root, floats)
        digests[name] = {"sha256": hashlib.sha256(data).hexdigest(), "floats": floats}
    return digests


def differences(found: dict[str, dict[str, Any]],
                expected: dict[str, dict[str, Any]]) -> list[str]:
    """Files whose contents differ, or whose floats differ by more than FLOAT_TOLERANCE."""
    changed = []
    for name in sorted(expected):
        a, b = found[name], expected[name]
        close = len(a["floats"]) == len(b["floats"]) and all(
            x == y or abs(x - y) <= FLOAT_TOLERANCE  # == for the infinities of limits
            for x, y in zip(a["floats"], b["floats"], strict=True))
        if a["sha256"] != b["sha256"] or not close:
            changed.append(name)
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the fixture")
    parser.add_argument("--models", type=Path, default=PACKAGE / "sample",
                        help="folder holding captioner/ and vq32/ (default: the package's)")
    parser.add_argument("--write", type=Path, help="write the digest here")
    args = parser.parse_args()
    with exclusive():
        digests = digest(build(args.models))
        shutil.rmtree(ROOT, ignore_errors=True)
    text = json.dumps(digests, indent=1, sort_keys=True) + "\n"
    if args.update:
        DIGEST_FILE.parent.mkdir(exist_ok=True)
        DIGEST_FILE.write_text(text)
    if args.write:
        args.write.write_text(text)
    print(f"{len(digests)} files digested")


if __name__ == "__main__":
    main()
