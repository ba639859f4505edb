"""A three-row dataset written by hand (no Ray, no models): for the read-only verbs' tests.

One shard: two kept samples (t2i and i2t, 16 image tokens each) and one row dropped as
``too_small``; a manifest shaped like build_manifest's, with CLIP on and recaption stats.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from pairforge.config import PairforgeConfig

ROWS = [
    {"key": "000000000", "status": "ok", "error": None, "caption": "a red square",
     "recaption": "a red square on a grey background", "caption_source": "recaption",
     "clip_score": 0.31, "task": "t2i", "n_image_tokens": 16, "n_caption_tokens": 7,
     "colour": "red"},
    {"key": "000000001", "status": "ok", "error": None, "caption": "blue circle",
     "recaption": None, "caption_source": "original", "clip_score": 0.29, "task": "i2t",
     "n_image_tokens": 16, "n_caption_tokens": 3, "colour": "blue"},
    {"key": "000000002", "status": "too_small", "error": "original 40x40 < 200 px",
     "caption": "tiny", "recaption": None, "caption_source": None, "clip_score": None,
     "task": None, "n_image_tokens": None, "n_caption_tokens": None, "colour": "green"},
]


def _bytes(write) -> bytes:  # noqa: ANN001
    buffer = io.BytesIO()
    write(buffer)
    return buffer.getvalue()


def _tar(path: Path, rows: list[dict]) -> None:
    with tarfile.open(path, "w") as tar:
        for row in rows:
            image = Image.new("RGB", (32, 32), row["colour"])
            meta = {k: row[k] for k in ("key", "caption", "recaption", "caption_source",
                                        "clip_score", "task", "n_image_tokens")}
            members = {
                "jpg": _bytes(lambda f, im=image: im.save(f, format="JPEG")),
                "txt": (row["recaption"] or row["caption"]).encode(),
                "json": json.dumps(meta).encode(),
                "vq.npy": _bytes(lambda f: np.save(f, np.zeros((4, 4), np.int32))),
                "tok.npy": _bytes(lambda f, n=row["n_caption_tokens"]:
                                  np.save(f, np.arange(n, dtype=np.int32)))}
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{row['key']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def manifest(out: Path) -> dict:
    cfg = PairforgeConfig(input={"path": "in.csv"}, output={"path": str(out)},
                          process={"clip": {"enabled": True}})
    tasks = {"i2t": {"samples": 1, "image_tokens": 16, "caption_tokens": 3,
                     "sequence_tokens": 23},
             "t2i": {"samples": 1, "image_tokens": 16, "caption_tokens": 7,
                     "sequence_tokens": 27}}
    return {
        "manifest_version": 1, "config": cfg.model_dump(mode="json"), "vocab": None,
        "models": {"clip": "tiny-clip", "clip_threshold": 0.28, "recaption": None},
        "classifiers": [],
        "recaption": {"rows": 2, "origin": {"model": 1, "cache": 1}, "abstained": 0,
                      "rows_with_attributes_removed": 0, "regenerated": 0,
                      "caption_source": {"recaption": 1, "original": 1}},
        "steps": {"basic": {"rows_in": 3, "rows_out": 2, "ended": {"too_small": 1},
                            "seconds": 0.01}},
        "budget": {"p_drop": 0.1, "target_unconditional_share": 0.1,
                   "realized_unconditional_share": 0.5, "realized_i2t_share": 0.5,
                   "max_prefix_deviation_tokens": 15.0},
        "totals": {"samples": 2, "tasks": tasks},
        "shards": [{"name": "00000.tar", "samples": 2, "rows": 3, "tasks": tasks,
                    "budget": {"p_drop": 0.1, "realized": 0.5, "max_prefix_deviation": 15.0,
                               "max_image_tokens": 16},
                    "settings_digest": None, "status": {"ok": 2, "too_small": 1}}],
        "funnel": {"input_rows": 3, "download": {"ok": 3}, "final": {"ok": 2, "too_small": 1}},
    }


def write_tiny_dataset(out: Path) -> Path:
    """The dataset under ``out`` (created); returns ``out``."""
    shards = out / "shards"
    shards.mkdir(parents=True)
    _tar(shards / "00000.tar", [r for r in ROWS if r["status"] == "ok"])
    table = pa.Table.from_pylist([{k: v for k, v in r.items() if k != "colour"} for r in ROWS])
    pq.write_table(table, shards / "00000.parquet")
    (out / "manifest.json").write_text(json.dumps(manifest(out)))
    return out
