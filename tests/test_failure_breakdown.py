"""The failure breakdown (shards/failures.py): each raw shard's top hosts by failed rows,
folded by the manifest into a bounded table that inspect and report show with the
statuses' meanings. A build against three loopback hosts (ports of 127.0.0.1): one
serves images, one answers 404 and 503, one refuses connections."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from loopback_server import LoopbackServer, make_images

from pairforge.shards.failures import HostFailures, breakdown_rows, merge_sections


def test_sections_add_up_and_stay_bounded():
    fold = HostFailures(keep=3)
    for i in range(10):  # host i fails i + 1 times
        fold.add_section({"hosts": [{"host": f"h{i}", "failed": i + 1,
                                     "status": {"timeout": i + 1}}], "other_hosts": 1})
    assert len(fold.hosts) <= 6  # pruned to 3 whenever it held more than 6
    section = fold.section(2)
    assert [h["host"] for h in section["hosts"]] == ["h9", "h8"]
    assert [h["failed"] for h in section["hosts"]] == [10, 9]
    # every failed row is somewhere: the two shown, or other hosts
    assert sum(h["failed"] for h in section["hosts"]) + section["other_hosts"] == 55 + 10


def test_parts_merge_per_host_and_status():
    a = {"hosts": [{"host": "x", "failed": 2, "status": {"timeout": 2}}], "other_hosts": 0}
    b = {"hosts": [{"host": "x", "failed": 1, "status": {"http_error": 1}},
                   {"host": "y", "failed": 1, "status": {"timeout": 1}}], "other_hosts": 3}
    merged = merge_sections([a, b], top=1)
    assert merged == {"hosts": [{"host": "x", "failed": 3,
                                 "status": {"timeout": 2, "http_error": 1}}],
                      "other_hosts": 4}
    rows = breakdown_rows(merged)
    assert rows[0][:4] == ["x", 3, "timeout", 2] and rows[1][:4] == ["", "", "http_error", 1]
    assert rows[0][4].startswith("connect or read") and rows[-1][:2] == ["(other hosts)", 4]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again at once: connections are refused


@pytest.fixture
def built(tmp_path: Path, ray_env: dict[str, str]) -> tuple[Path, str, str, str]:
    images = tmp_path / "images"
    make_images(images)
    with LoopbackServer(images) as good, LoopbackServer(images) as failing:
        refused = f"http://127.0.0.1:{_closed_port()}"
        urls = ([good.url("/img/red.jpg")] * 3 + [failing.url("/status/404")] * 4
                + [failing.url("/status/503")] * 2 + [f"{refused}/img/red.jpg"] * 5)
        (tmp_path / "in.csv").write_text("url,caption\n" + "".join(
            f"{u},a red square on white\n" for u in urls))
        cfg = {"input": {"path": str(tmp_path / "in.csv"), "shard_size": 6},
               "output": {"path": str(tmp_path / "out")},
               "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
               "download": {"threads": 4, "retries": 0, "timeout": 5,
                            "allow_addresses": ["127.0.0.1/32"],
                            "image": {"image_size": 32}},
               "dedup": {"enabled": False},
               "process": {"basic": {"min_image_side": 8}}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        done = subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                               str(tmp_path / "c.yaml"), "-q"], capture_output=True,
                              text=True, timeout=600, env=ray_env)
        bases = good.base_url, failing.base_url
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "out", *bases, refused


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pairforge.cli", *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})


def test_inspect_and_report_show_the_top_hosts_with_statuses(built, tmp_path):
    out, _, failing, refused = built
    failing_host, refused_host = failing.split("//")[1], refused.split("//")[1]
    data = json.loads(_cli("inspect", str(out), "--json").stdout)
    assert data["funnel"] == {"ok": 3, "http_error": 6, "download_error": 5}
    section = data["failures_by_host"]
    assert section["hosts"] == [
        {"host": failing_host, "failed": 6, "status": {"http_error": 6}},
        {"host": refused_host, "failed": 5, "status": {"download_error": 5}}]
    assert section["other_hosts"] == 0 and section["shards_without_breakdown"] == 0
    # each raw shard keeps its own part of it
    raw = [json.loads(p.read_text()) for p in sorted((out / "raw").glob("*_stats.json"))]
    assert sum(h["failed"] for s in raw for h in s["failures_by_host"]["hosts"]) == 11

    shown = _cli("inspect", str(out)).stdout
    assert "top hosts by failures" in shown
    assert failing_host in shown and refused_host in shown
    assert "connection failed or the server answered nonsense" in shown  # the meaning

    page = tmp_path / "report.html"
    assert _cli("report", str(out), "-o", str(page)).returncode == 0
    html = page.read_text()
    assert 'id="failures"' in html and failing_host in html and refused_host in html
