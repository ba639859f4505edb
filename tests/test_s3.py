"""Object storage (moto's standalone server on loopback, through s3fs): what replaces
rename on S3. An object is uploaded whole on close, a writer that fails uploads nothing,
and a shard without its stats object is not complete.

The whole build that reads from and writes to S3 is checked in tests/test_cluster.py, the
other user of that build (one session fixture, so one pytest worker builds it).
"""

from __future__ import annotations

import uuid

import fsspec
import pytest

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
