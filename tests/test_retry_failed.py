"""``pairforge download --retry-failed`` (download/refetch.py, pipeline/retry_failed.py):
after a run where a tenth of the rows failed transiently, only those rows are fetched
again (the loopback server's log), every one ends ok, permanent failures stay, and the
shards without a transient row are not touched (mtimes and bytes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import webdataset as wds
from conftest import COCO_IMAGES
from loopback_server import LoopbackServer

from pairforge.config import parse_config
from pairforge.pipeline.dedup_stage import run_dedup
from pairforge.pipeline.download_stage import run_download
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.retry_failed import run_retry_failed
from pairforge.records import Status, is_transient_failure

IMAGE = "sample_5.jpg"


class OnceServer(LoopbackServer):
    """``/pic/<id>``: the image (one path per row, so hits count rows);
    ``/broken/<kind>/<id>``: while ``broken`` is set, a failure (``503``, or ``reset``:
    the connection closes without an answer; the client may try that once more on a new
    connection when the closed one was reused), the image after."""

    def __init__(self, image_dir: Path) -> None:
        super().__init__(image_dir)
        self.broken = True

    def _route_pic(self, handler, rest: str, query: dict[str, str]) -> None:  # noqa: ANN001
        self._send_image(handler, IMAGE)

    def _route_broken(self, handler, rest: str, query: dict[str, str]) -> None:  # noqa: ANN001
        if not self.broken:
            self._send_image(handler, IMAGE)
        elif rest.startswith("reset/"):
            handler.close_connection = True
            handler.connection.close()
        else:
            handler.send_body(503, b"busy", "text/plain")


@pytest.fixture
def server():
    with OnceServer(COCO_IMAGES) as srv:
        yield srv


def _urls(server: OnceServer) -> list[str]:
    """40 rows in 4 shards of 10: shards 0 and 3 all fine; shard 1 with three 503s and a
    404, shard 2 with a reset connection and a 404."""
    urls = [server.url(f"/pic/{i}") for i in range(40)]
    for i in (11, 14, 17):
        urls[i] = server.url(f"/broken/503/{i}")
    urls[22] = server.url("/broken/reset/22")
    urls[13] = urls[25] = server.url("/status/404")
    return urls


def _config(tmp_path: Path, urls: list[str]):
    (tmp_path / "in.csv").write_text("url,caption\n" + "".join(
        f"{u},a photo {i}\n" for i, u in enumerate(urls)))
    return parse_config({
        "input": {"path": str(tmp_path / "in.csv"), "shard_size": 10},
        "output": {"path": str(tmp_path / "out")},
        "ray": {"num_cpus": 2},
        "download": {"threads": 4, "timeout": 5, "retries": 0,
                     "allow_addresses": ["127.0.0.1/32"], "image": {"image_size": 64}}})


def _path(url: str) -> str:
    return "/" + url.split("/", 3)[3]


def _files(raw: Path) -> dict[str, tuple[int, str]]:
    return {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(raw.iterdir())}


def _samples(raw: Path, shard: int) -> dict[str, dict]:
    return {s["__key__"]: s for s in wds.WebDataset(str(raw / f"{shard:05d}.tar"),
                                                    shardshuffle=False)}


def test_transient_failures_are_classified_from_the_raw_columns():
    assert is_transient_failure("timeout", None, "timed out")
    assert is_transient_failure("host_paused", None, "given up")
    assert is_transient_failure("http_error", 503, "HTTP 503")
    assert is_transient_failure("http_error", 429, "HTTP 429 (after 3 tries)")
    assert not is_transient_failure("http_error", 404, "HTTP 404")
    assert is_transient_failure("download_error", None,
                                "ConnectionRefusedError: [Errno 111] Connection refused")
    assert is_transient_failure("download_error", None, "bad response: RemoteDisconnected: x")
    assert not is_transient_failure("download_error", None, "DNS lookup failed: x")
    assert not is_transient_failure("download_error", None, "TLS certificate: expired")
    assert not is_transient_failure("decode_error", None, "truncated")


def test_retry_failed_refetches_only_transient_rows_and_leaves_other_shards(
        tmp_path, server, ray_local):
    urls = _urls(server)
    cfg = _config(tmp_path, urls)
    run_download(cfg, RunOptions(show_progress=False))
    raw = tmp_path / "out" / "raw"
    first = pq.read_table(sorted(raw.glob("*.parquet"))).to_pylist()
    statuses = [r["status"] for r in first]
    assert statuses.count("ok") == 34 and statuses.count("http_error") == 5
    assert statuses[22] == "download_error"
    # stage 2 before the retry: every ok row is the same image, one kept
    dedup = str(tmp_path / "out" / "dedup")
    decided = run_dedup(str(raw), dedup, cfg.dedup, cfg.ray)
    assert (decided["ok_rows"], decided["kept"], decided["duplicate_exact"]) == (34, 1, 33)
    before = _files(raw)
    samples_before = {s: _samples(raw, s) for s in range(4)}
    hits_before = {u: server.hits(_path(u)) for u in urls}
    # a training shard made from shard 1 (its stats file is what makes it complete)
    (tmp_path / "out" / "shards").mkdir()
    for shard in (0, 1):
        (tmp_path / "out" / "shards" / f"0000{shard}_stats.json").write_text("{}")

    server.broken = False  # the hosts recovered
    summary = run_retry_failed(cfg, RunOptions(show_progress=False))

    after = pq.read_table(sorted(raw.glob("*.parquet"))).to_pylist()
    assert [r["key"] for r in after] == [r["key"] for r in first]
    expected = ["http_error" if i in (13, 25) else "ok" for i in range(40)]
    assert [r["status"] for r in after] == expected
    assert summary["retried"] == {"shards": 2, "rows": 4, "ok": 4}
    assert summary["status"] == {"ok": 38, "http_error": 2}
    # the server saw the retried rows once more, nothing else: no ok row, no 404 again
    for i, url in enumerate(urls):
        again = 1 if i in (11, 14, 17, 22) else 0
        assert server.hits(_path(url)) == hits_before[url] + again, (i, url)
    # shards 0 and 3 were not touched; 1 and 2 were rewritten
    now = _files(raw)
    for name in ("00000.tar", "00000.parquet", "00000_stats.json",
                 "00003.tar", "00003.parquet", "00003_stats.json"):
        assert now[name] == before[name], name
    assert now["00001.tar"] != before["00001.tar"] and now["00002.tar"] != before["00002.tar"]
    # samples that were ok before are the same bytes; the new ones read back whole
    for shard in (1, 2):
        samples = _samples(raw, shard)
        assert sorted(samples) == [r["key"] for r in after
                                   if r["status"] == "ok" and int(r["key"][:5]) == shard]
        for key, sample in samples_before[shard].items():
            assert {k: v for k, v in samples[key].items() if k != "__url__"} == \
                {k: v for k, v in sample.items() if k != "__url__"}
        new = [k for k in samples if k not in samples_before[shard]]
        assert len(new) == {1: 3, 2: 1}[shard]
        assert all(json.loads(samples[k]["json"])["status"] == "ok" for k in new)
    stats = json.loads((raw / "00001_stats.json").read_text())
    assert stats["retried"]["rows"] == 3 and stats["retried"]["ok"] == 3
    assert stats["status"] == {"ok": 9, "http_error": 1}
    assert stats["failures_by_host"]["hosts"][0]["status"] == {"http_error": 1}
    # the training shard made from the old shard 1 is incomplete now; shard 0's is not
    assert not (tmp_path / "out" / "shards" / "00001_stats.json").exists()
    assert (tmp_path / "out" / "shards" / "00000_stats.json").exists()

    # stage 2 again: only the four rows the retry made ok are read and decided, against
    # the earlier survivor; no earlier decision moves
    appended = run_dedup(str(raw), dedup, cfg.dedup, cfg.ray)
    assert appended["last_run"] == {"mode": "append", "raw_files_read": 2,
                                    "rewritten_raw_files": 2, "index_rows_read": 1}
    assert (appended["ok_rows"], appended["kept"], appended["duplicate_exact"]) == (38, 1, 37)
    assert appended["status_counts"] == {"http_error": 2, "ok": 38}
    table = pq.read_table(tmp_path / "out" / "dedup" / "duplicates.parquet")
    assert len(set(table["kept_key"].to_pylist())) == 1 and table["key"].to_pylist() == \
        sorted(r["key"] for r in after if r["status"] == "ok")[1:]

    # nothing transient is left: a second retry touches nothing
    settled = _files(raw)
    again = run_retry_failed(cfg, RunOptions(show_progress=False))
    assert again["retried"] == {"shards": 0, "rows": 0, "ok": 0}
    assert _files(raw) == settled
    assert Status.OK in again["status"]
