"""Every sample carries the same json fields with the same types, and OUT/features.json lets
Hugging Face ``datasets`` load shards whose first samples have only nulls and empty lists.

The shards are written by the stage-3 writer itself (shards/training.py) from a raw tar
made here; only the rows' values are chosen, so that the first shard has no CLIP score and
no recaption flag anywhere and the last shard has both.
"""

from __future__ import annotations

import io
import json

import datasets
import pyarrow as pa
import pytest
from PIL import Image

from pairforge.config import TasksConfig
from pairforge.records import SAMPLE_FIELDS, json_safe, process_fields, raw_schema
from pairforge.shards.features import hf_features
from pairforge.shards.manifest import Manifest, write_dataset_files
from pairforge.shards.storage import RAW_FOLDER, OutputDir
from pairforge.shards.tar import SampleTarWriter
from pairforge.shards.training import write_training_shard

ROWS_PER_SHARD = 3


def _jpeg(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 12), colour).save(buffer, "JPEG")
    return buffer.getvalue()


def _rows(shard_id: int, scored: bool) -> list[dict]:
    rows = []
    for i in range(ROWS_PER_SHARD):
        rows.append({
            "key": f"{shard_id:05d}{i:04d}", "url": f"http://127.0.0.1/{shard_id}/{i}.jpg",
            "caption": f"photo {i}", "status": "ok", "error": None, "http_status": 200,
            "image_format": "jpg", "width": 16, "height": 12, "original_width": 16,
            "original_height": 12, "sha256": "ab" * 32, "pixel_hash": "cd" * 32,
            "phash": 2**63 + i, "exif": None, "duplicate_of": None,
            "clip_score": 0.25 + i / 100 if scored else None,
            "recaption": f"a red square {i}" if scored else None,
            "recaption_flags": ["attribute:gender:man"] if scored else [],
            "recaption_origin": "model" if scored else None,
            "caption_source": "recaption" if scored else "original",
            "train_caption": f"a red square {i}" if scored else f"photo {i}"})
    return rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("typed")
    out = OutputDir(str(root))
    out.makedirs(RAW_FOLDER)
    provided = {n: t for n, t in [("clip_score", pa.float32()), ("recaption", pa.string()),
                                  ("recaption_flags", pa.list_(pa.string())),
                                  ("recaption_origin", pa.string()),
                                  ("caption_source", pa.string()),
                                  ("train_caption", pa.string())]}
    schema = pa.schema([*raw_schema(), *process_fields(provided)])
    shards = []
    for shard_id, scored in ((0, False), (1, False), (2, True)):
        rows = _rows(shard_id, scored)
        with out.open_atomic(RAW_FOLDER, f"{shard_id:05d}.tar") as f, SampleTarWriter(f) as w:
            for r in rows:
                w.write(r["key"], {"jpg": _jpeg((200, 10 * shard_id, 30))})
        stats = write_training_shard(out, shard_id, rows, schema, SAMPLE_FIELDS, {},
                                     TasksConfig())
        shards.append({"name": f"{shard_id:05d}.tar", "samples": stats["successes"]})
        expected = [json_safe({f: r.get(f) for f in SAMPLE_FIELDS}) for r in rows]
        shards[-1]["expected"] = expected
    with Manifest({"vocab": None,
                   "config": {"download": {"image": {"encode_format": "jpg"}}}}) as manifest:
        for shard_id, entry in enumerate(shards):
            manifest.add_shard(shard_id, entry)
        write_dataset_files(out, manifest)
    return root, [e for s in shards for e in s["expected"]]


def test_every_sample_has_every_field(dataset):
    root, expected = dataset
    assert all(set(e) == set(SAMPLE_FIELDS) for e in expected)
    assert json.loads((root / "features.json").read_text()) == hf_features("jpg", False)


def test_inference_from_the_first_samples_fails_without_the_features(dataset, tmp_path):
    root, _ = dataset
    tars = sorted(str(p) for p in (root / "shards").glob("*.tar"))
    with pytest.raises(datasets.exceptions.DatasetGenerationError) as err:
        datasets.load_dataset("webdataset", data_files={"train": tars}, split="train",
                              cache_dir=str(tmp_path / "hf"))
    assert "Couldn't cast array of type double to null" in str(err.value.__cause__)


def test_features_json_loads_every_shard_and_every_value_round_trips(dataset, tmp_path):
    root, expected = dataset
    tars = sorted(str(p) for p in (root / "shards").glob("*.tar"))
    features = datasets.Features.from_dict(json.loads((root / "features.json").read_text()))
    ds = datasets.load_dataset("webdataset", data_files={"train": tars}, split="train",
                               features=features, cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == 3 * ROWS_PER_SHARD
    got = sorted(ds["json"], key=lambda j: j["key"])
    for row, want in zip(got, expected, strict=True):
        if want["clip_score"] is not None:
            assert row.pop("clip_score") == pytest.approx(want.pop("clip_score"), abs=1e-6)
        assert row == want
    assert sorted(ds["txt"])[:3] == ["a red square 0", "a red square 1", "a red square 2"]
