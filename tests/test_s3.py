"""Object storage: a whole build reads its input from and writes everything to S3 (moto's
standalone server on loopback, through s3fs), and plain webdataset reads the shards back.

Also what replaces rename on S3: an object is uploaded whole on close, a writer that fails
uploads nothing, and a shard without its stats object is not complete.
"""

from __future__ import annotations

import io
import json
import shlex
import sys
import uuid
from typing import Any

import fsspec
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from conftest import CLUSTER_IMAGES, CLUSTER_SHARD_SIZE

from pairforge.shards.raw import RawShardWriter, completed_shards
from pairforge.shards.storage import OutputDir


@pytest.fixture(autouse=True)
def _loopback_only(s3_server, monkeypatch) -> None:
    """This process talks to S3 too: only to moto, never to AWS or the metadata service."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def bucket(s3_server) -> str:
    name = f"pf-{uuid.uuid4().hex[:10]}"
    fsspec.filesystem("s3", **s3_server.storage_options).mkdir(name)
    return name


def _fs(s3_server) -> fsspec.AbstractFileSystem:
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    fs.invalidate_cache()
    return fs


def test_failed_writer_leaves_no_object(s3_server, bucket):
    out = OutputDir(f"s3://{bucket}/out", s3_server.storage_options)
    for size in (1000, 6 * 1024**2):  # a one-shot PUT, and a multipart upload (> 5 MiB)
        with pytest.raises(RuntimeError), out.open_atomic("raw", f"{size}.tar") as f:
            f.write(b"x" * size)
            raise RuntimeError("writer dies mid-file")
        assert not out.exists("raw", f"{size}.tar")
    fs = _fs(s3_server)
    # An aborted multipart upload leaves no pending parts behind either.
    pending = fs.call_s3("list_multipart_uploads", Bucket=bucket)
    assert not pending.get("Uploads")
    with out.open_atomic("raw", "ok.tar") as f:
        f.write(b"y" * (6 * 1024**2))
    assert fs.size(f"{bucket}/out/raw/ok.tar") == 6 * 1024**2


# RawShardWriter.abort leaves its tarfile to the garbage collector, whose close then finds
# the upload abandoned: the error that proves nothing was written, not a failure.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_aborted_raw_shard_is_not_complete(s3_server, bucket):
    out = OutputDir(f"s3://{bucket}/out", s3_server.storage_options)
    writer = RawShardWriter(out, "raw", 0, [])
    writer.add({"key": "000000000", "url": "u", "caption": "c", "status": "ok"}, b"jpg",
               "jpg", {})
    writer.abort(RuntimeError("killed"))
    assert out.glob("raw/*") == []
    assert completed_shards(out, "raw") == set()


def _pipe_url(url: str, storage_options: dict[str, Any]) -> str:
    """A webdataset ``pipe:`` URL that streams one object through fsspec."""
    code = ("import fsspec, json, shutil, sys; "
            "f = fsspec.open(sys.argv[1], 'rb', **json.loads(sys.argv[2])).open(); "
            "shutil.copyfileobj(f, sys.stdout.buffer)")
    return "pipe:" + " ".join(shlex.quote(a) for a in
                              [sys.executable, "-c", code, url, json.dumps(storage_options)])


@pytest.mark.slow
def test_build_reads_and_writes_s3(s3_server, s3_cluster_build):
    """The whole build went through S3: input list, raw shards, dedup tables, training
    shards, stats, manifest; nothing local, nothing temporary; webdataset reads it back."""
    bucket, opts = s3_cluster_build["bucket"], s3_server.storage_options
    assert sorted(p.name for p in (s3_cluster_build["folder"] / "run").iterdir()) == [
        "build.yaml"]  # the driver wrote nothing to local disk
    fs = _fs(s3_server)
    keys = {k.split("/out/", 1)[1] for k in fs.find(f"{bucket}/out")}
    for i in range(CLUSTER_IMAGES // CLUSTER_SHARD_SIZE):
        for folder in ("raw", "shards"):
            assert {f"{folder}/{i:05d}.tar", f"{folder}/{i:05d}.parquet",
                    f"{folder}/{i:05d}_stats.json"} <= keys
    assert {"dedup/duplicates.parquet", "dedup/index.parquet", "dedup/dedup_stats.json",
            "manifest.json", "sizes.json", "index.wids.json"} <= keys
    assert not [k for k in keys if ".tmp-" in k]
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")

    manifest = json.loads(fs.cat(f"{bucket}/out/manifest.json"))
    assert manifest["funnel"]["input_rows"] == CLUSTER_IMAGES
    assert manifest["funnel"]["download"]["http_error"] == 1
    with fs.open(f"{bucket}/out/shards/00000.parquet", "rb") as f:
        assert pq.read_table(f).num_rows == CLUSTER_SHARD_SIZE
    sizes = json.loads(fs.cat(f"{bucket}/out/sizes.json"))

    # Plain webdataset over the same storage: every sample exactly once, and complete.
    urls = [_pipe_url(f"s3://{bucket}/out/shards/{name}", opts) for name in sorted(sizes)]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert len(samples) == sum(sizes.values()) == manifest["totals"]["samples"] > 0
    assert len({s["__key__"] for s in samples}) == len(samples)
    for sample in samples:
        assert {"jpg", "txt", "json", "vq.npy", "tok.npy"} <= set(sample)
        assert json.loads(sample["json"])["task"] in ("t2i", "i2t", "img")
    tokens = sum(_npy(s["vq.npy"]).size for s in samples)
    assert tokens == sum(t["image_tokens"] for t in manifest["totals"]["tasks"].values())


def _npy(data: bytes) -> Any:
    import numpy as np

    return np.load(io.BytesIO(data))

