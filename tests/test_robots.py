"""robots.txt (RFC 9309) and TDM reservations (W3C TDMRep) in stage 1 (download/consent.py),
against loopback servers only: 127.0.0.1, and 127.0.0.2 as "another host". What the servers
logged is the evidence: 0 requests to disallowed paths, each policy file fetched once per
host per run, and requests to a host with a Crawl-delay never closer than that."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from loopback_server import LoopbackServer, make_images

from pairforge.config import ConfigError, DownloadConfig, parse_config
from pairforge.download.consent import FILE_MAX_BYTES, ConsentGate, merge_stats
from pairforge.download.shard import download_shard
from pairforge.download.tdmrep import parse_tdmrep, reservation_for
from pairforge.pipeline.contract import shard_config
from pairforge.pipeline.download_stage import input_shards
from pairforge.pipeline.settings import settings_record, stage_settings

ROBOTS = "/robots.txt"
TDMREP = "/.well-known/tdmrep.json"


class PolicyServer(LoopbackServer):
    """The loopback server plus fixed answers per path (``files``: path -> (status, body,
    headers)), and the arrival time of every request (``arrivals``)."""

    def __init__(self, image_dir: Path, host: str = "127.0.0.1") -> None:
        super().__init__(image_dir, host)
        self.files: dict[str, tuple[int, bytes, list[tuple[str, str]]]] = {}
        self.arrivals: list[tuple[float, str]] = []
        self._arrivals_lock = threading.Lock()

    def answer(self, path: str, body: str | bytes, status: int = 200,
               headers: list[tuple[str, str]] | None = None) -> None:
        self.files[path] = (status, body.encode() if isinstance(body, str) else body,
                            headers or [])

    def _record(self, path: str, headers: dict[str, str]) -> None:
        with self._arrivals_lock:
            self.arrivals.append((time.monotonic(), path))
        super()._record(path, headers)

    def _route(self, handler, path: str, query: dict[str, str]) -> None:  # noqa: ANN001
        if path in self.files:
            status, body, headers = self.files[path]
            handler.send_body(status, body, "text/plain", headers)
        else:
            super()._route(handler, path, query)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    make_images(folder)
    (folder / "private_red.jpg").write_bytes((folder / "red.jpg").read_bytes())
    return folder


@pytest.fixture(autouse=True)
def node_temp(tmp_path, monkeypatch) -> Path:
    """The node's temporary folder (where tasks share policy files): the test's own."""
    folder = tmp_path / "node-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def server(images):
    with PolicyServer(images) as srv:
        yield srv


def _config(tmp_path: Path, urls: list[str], **download: Any):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "in.csv").write_text("url,caption\n" + "".join(
        f"{u},photo {i}\n" for i, u in enumerate(urls)))
    return parse_config({
        "input": {"path": str(tmp_path / "in.csv"), "shard_size": 1000},
        "output": {"path": str(tmp_path / "out")},
        "download": {"threads": 4, "timeout": 2.0, "retries": 0,
                     "allow_addresses": ["127.0.0.1/32", "127.0.0.2/32"],
                     "image": {"image_size": 32}, **download}})


def _run(tmp_path: Path, urls: list[str], run_id: str = "test", **download: Any
         ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One shard task over ``urls``: its rows (input order) and stats."""
    cfg = _config(tmp_path, urls, **download)
    with input_shards(cfg) as shards:
        stats = download_shard(shards[0], shard_config(cfg),
                               settings_record(stage_settings(cfg, "download")),
                               run_id=run_id)
    rows = pq.read_table(tmp_path / "out" / "raw" / "00000.parquet").to_pylist()
    return rows, stats


def _statuses(rows: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    return [(r["status"], r["opt_out_reason"]) for r in rows]


# --------------------------------------------------------------------------- robots.txt


def test_allow_all_and_missing_files_fetch_each_once(tmp_path, server):
    server.answer(ROBOTS, "User-agent: *\nAllow: /\n")  # tdmrep.json: the server's 404
    urls = [server.url(f"/img/{n}") for n in ("red.jpg", "blue.png", "green.webp")] * 3
    rows, stats = _run(tmp_path, urls)
    assert _statuses(rows) == [("ok", None)] * 9
    assert server.hits(ROBOTS) == 1 and server.hits(TDMREP) == 1
    assert stats["consent"]["fetched"] == {ROBOTS: 1, TDMREP: 1}
    assert stats["consent"]["opted_out"] == {}
    ua = server.headers_seen(ROBOTS)[0]["User-Agent"]
    assert ua.startswith("pairforge/") and "(+https://" in ua  # names a contact URL


def test_disallowed_paths_are_never_requested(tmp_path, server):
    server.answer(ROBOTS, "User-agent: otherbot\nDisallow: /\n\n"
                          "User-agent: pairforge\nDisallow: /img/private\nAllow: /img/\n")
    urls = [server.url("/img/red.jpg"), server.url("/img/private_red.jpg"),
            server.url("/img/blue.png"), server.url("/img/private_red.jpg?size=2")]
    rows, stats = _run(tmp_path, urls)
    assert _statuses(rows) == [("ok", None), ("opted_out", "robots"), ("ok", None),
                               ("opted_out", "robots")]
    assert "robots.txt of http://127.0.0.1:" in rows[1]["error"]
    assert rows[1]["http_status"] is None  # no request was made for it
    assert server.hits("/img/private_red.jpg") == 0
    assert server.hits(ROBOTS) == 1
    host = f"127.0.0.1:{server.port}"
    assert stats["consent"]["opted_out"] == {"robots": 2}
    assert stats["consent"]["hosts"] == {host: {"robots": 2}}


def test_the_group_of_the_configured_user_agent_applies(tmp_path, server):
    server.answer(ROBOTS, "User-agent: *\nDisallow: /\n\nUser-agent: mybot\nAllow: /\n")
    url = server.url("/img/red.jpg")
    rows, _ = _run(tmp_path, [url], user_agent="MyBot/2.1 (+https://example.org/bot)")
    assert _statuses(rows) == [("ok", None)]
    assert server.headers_seen("/img/red.jpg")[0]["User-Agent"].startswith("MyBot/2.1")
    rows, _ = _run(tmp_path / "default", [url], run_id="other")
    assert _statuses(rows) == [("opted_out", "robots")]
    assert server.hits("/img/red.jpg") == 1


def test_crawl_delay_spaces_requests_across_threads(tmp_path, server):
    server.answer(ROBOTS, "User-agent: *\nCrawl-delay: 0.25\n")
    urls = [server.url(f"/img/{n}") for n in ("red.jpg", "blue.png", "green.webp")] * 2
    started = time.monotonic()
    rows, stats = _run(tmp_path, urls, threads=6)
    assert _statuses(rows) == [("ok", None)] * 6
    times = sorted(t for t, path in server.arrivals if path.startswith("/img/"))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(times) == 6
    # the client's clock spaces the sends; 30 ms covers scheduling between send and arrival
    # on a loaded 2-core host (a gap of 0.240 s was seen at load average 7.5)
    assert min(gaps) >= 0.25 - 0.03, gaps
    assert time.monotonic() - started >= 5 * 0.25
    (origin,) = stats["consent"]["origins"].values()
    assert origin == {"robots_txt": "ok", "crawl_delay": 0.25}


def test_robots_404_allows_all(tmp_path, server):
    rows, stats = _run(tmp_path, [server.url("/img/red.jpg"), server.url("/img/blue.png")])
    assert _statuses(rows) == [("ok", None)] * 2
    assert server.hits(ROBOTS) == 1
    assert stats["consent"]["origins"] == {}


@pytest.mark.parametrize("code", [500, 503, 429])
def test_robots_5xx_disallows_the_host_for_the_run(tmp_path, server, code):
    server.answer(ROBOTS, "busy", status=code)
    urls = [server.url("/img/red.jpg"), server.url("/img/blue.png")]
    rows, stats = _run(tmp_path, urls)
    # a transient failure of the host, not its consent: --retry-failed may try them again
    assert [(r["status"], r["http_status"]) for r in rows] == [("http_error", code)] * 2
    assert all("robots.txt of" in r["error"] and "unreachable" in r["error"] for r in rows)
    assert server.hits("/img/red.jpg") == server.hits("/img/blue.png") == 0
    assert server.hits(ROBOTS) == 1  # download.retries is 0 here
    (origin,) = stats["consent"]["origins"].values()
    assert origin == {"robots_txt": "unreachable", "robots_unreachable": 2}


def test_robots_timeout_disallows_the_host(tmp_path, server):
    server.answer(ROBOTS, b"", status=302, headers=[("Location", server.url("/stall?secs=3"))])
    rows, _ = _run(tmp_path, [server.url("/img/red.jpg")], timeout=0.5)
    assert rows[0]["status"] == "timeout" and "robots.txt" in rows[0]["error"]
    assert server.hits("/img/red.jpg") == 0 and server.hits("/stall") == 1


def test_a_2mb_robots_file_is_cut_at_500_kib_and_read_leniently(tmp_path, server):
    head = "User-agent: *\nDisallow: /img/private\nthis line is not a rule\n"
    filler = "# " + "x" * 98 + "\n"
    body = head + filler * (2 * 1024 * 1024 // len(filler)) + "Disallow: /img/red\n"
    assert len(body) > 2_000_000 and len(head) < FILE_MAX_BYTES
    server.answer(ROBOTS, body)
    rows, _ = _run(tmp_path, [server.url("/img/private_red.jpg"), server.url("/img/red.jpg")])
    # the rule past the first 500 KiB was never read
    assert _statuses(rows) == [("opted_out", "robots"), ("ok", None)]
    assert server.hits("/img/private_red.jpg") == 0 and server.hits(ROBOTS) == 1


def test_robots_redirect_to_another_host_is_followed(tmp_path, images, server):
    with PolicyServer(images, "127.0.0.2") as other:
        other.answer("/policies/robots.txt", "User-agent: *\nDisallow: /img/blue\n")
        server.answer(ROBOTS, b"moved", status=301,
                      headers=[("Location", other.url("/policies/robots.txt"))])
        rows, _ = _run(tmp_path, [server.url("/img/blue.png"), server.url("/img/red.jpg")])
        assert other.hits("/policies/robots.txt") == 1
    assert _statuses(rows) == [("opted_out", "robots"), ("ok", None)]
    assert server.hits("/img/blue.png") == 0


def test_an_image_redirect_asks_the_other_host_robots(tmp_path, images, server):
    with PolicyServer(images, "127.0.0.2") as other:
        other.answer(ROBOTS, "User-agent: *\nDisallow: /img/\n")
        target = other.url("/img/red.jpg")
        rows, _ = _run(tmp_path, [server.url(f"/redirect-to?url={target}")])
        assert other.hits(ROBOTS) == 1 and other.hits("/img/red.jpg") == 0
    assert _statuses(rows) == [("opted_out", "robots")]
    assert server.hits("/redirect-to") == 1


def test_tasks_of_a_run_share_the_nodes_files(tmp_path, server):
    server.answer(ROBOTS, "User-agent: *\nDisallow: /img/private\n")
    urls = [server.url("/img/red.jpg"), server.url("/img/private_red.jpg")]
    first, stats1 = _run(tmp_path / "a", urls, run_id="shared")
    second, stats2 = _run(tmp_path / "b", urls, run_id="shared")  # another task, same run
    assert _statuses(first) == _statuses(second) == [("ok", None), ("opted_out", "robots")]
    assert server.hits(ROBOTS) == 1 and server.hits(TDMREP) == 1
    assert stats1["consent"]["fetched"] == {ROBOTS: 1, TDMREP: 1}
    assert stats2["consent"]["fetched"] == {}


def test_switched_off_fetches_no_policy_file(tmp_path, server):
    server.answer(ROBOTS, "User-agent: *\nDisallow: /\n")
    server.answer(TDMREP, json.dumps([{"location": "/", "tdm-reservation": 1}]))
    rows, stats = _run(tmp_path, [server.url("/img/red.jpg")], robots_txt=False, tdm=False)
    assert _statuses(rows) == [("ok", None)]
    assert server.hits(ROBOTS) == 0 and server.hits(TDMREP) == 0
    assert "fetched" not in stats["consent"]


def test_gate_cache_expires_after_its_ttl(tmp_path, server):
    server.answer(ROBOTS, "User-agent: *\nDisallow: /img/private\n")
    cfg = DownloadConfig(allow_addresses=["127.0.0.1/32"], tdm=False, timeout=2.0)
    gate = ConsentGate(cfg, tmp_path / "cache", ttl=0.2)
    origin = ("http", "127.0.0.1", server.port)
    try:
        assert gate.admit(server.url("/img/private_red.jpg"), origin).opt_out_reason == "robots"
        assert gate.admit(server.url("/img/red.jpg"), origin) is None
        assert server.hits(ROBOTS) == 1
        time.sleep(0.3)
        assert gate.admit(server.url("/img/red.jpg"), origin) is None
        assert server.hits(ROBOTS) == 2
    finally:
        gate.close()


def test_stage1_on_ray_fetches_each_file_once_per_host(tmp_path, images, server, ray_local,
                                                      monkeypatch):
    """Three shard tasks in two worker processes: robots.txt and tdmrep.json are fetched
    once per host for the run; the manifest-bound stats add up; the cache folder goes."""
    from pairforge.download.consent import cache_dir
    from pairforge.pipeline import download_stage
    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.entry import RunOptions

    monkeypatch.setattr(tempfile, "tempdir", None)  # the workers' temporary folder
    # this run's cache folder, by the run id the stage removes it by: the other test worker
    # may make and remove its own beside it meanwhile
    removed: list[str] = []
    original = download_stage.remove_cache
    monkeypatch.setattr(download_stage, "remove_cache",
                        lambda run_id: (removed.append(run_id), original(run_id)))
    server.answer(ROBOTS, "User-agent: *\nDisallow: /img/private\n")
    with PolicyServer(images, "127.0.0.2") as other:
        other.answer(TDMREP, json.dumps([{"location": "/img/blue", "tdm-reservation": 1}]))
        urls = [server.url("/img/red.jpg"), server.url("/img/private_red.jpg"),
                other.url("/img/blue.png"), other.url("/img/green.webp")] * 3
        cfg = _config(tmp_path, urls, processes=2)
        cfg.input.shard_size = 4
        summary = run_download(cfg, RunOptions(show_progress=False))
        assert (other.hits(ROBOTS), other.hits(TDMREP)) == (1, 1)
        assert other.hits("/img/blue.png") == 0
    assert (server.hits(ROBOTS), server.hits(TDMREP)) == (1, 1)
    assert server.hits("/img/private_red.jpg") == 0
    assert summary["status"] == {"ok": 6, "opted_out": 6}
    stats = [json.loads(f.read_text())["consent"]
             for f in sorted((tmp_path / "out" / "raw").glob("*_stats.json"))]
    assert len(stats) == 3 and all(s["opted_out"] == {"robots": 1, "tdm": 1} for s in stats)
    assert merge_stats(stats)["fetched"] == {ROBOTS: 2, TDMREP: 2}
    assert len(removed) == 1 and not cache_dir(removed[0]).exists()


# --------------------------------------------------------------------------- TDM


def test_tdmrep_rules_reserve_paths_before_any_request(tmp_path, server):
    server.answer(TDMREP, json.dumps([
        {"location": "/img/private*", "tdm-reservation": 1,
         "tdm-policy": "https://example.org/policy.json"},
        {"location": "/img/*.png$", "tdm-reservation": 1},
        {"location": "/img/", "tdm-reservation": 0}]))
    urls = [server.url("/img/private_red.jpg"), server.url("/img/blue.png"),
            server.url("/img/red.jpg"), server.url("/img/green.webp")]
    rows, stats = _run(tmp_path, urls)
    assert _statuses(rows) == [("opted_out", "tdm"), ("opted_out", "tdm"), ("ok", None),
                               ("ok", None)]
    assert "policy https://example.org/policy.json" in rows[0]["error"]
    assert server.hits("/img/private_red.jpg") == server.hits("/img/blue.png") == 0
    assert server.hits(TDMREP) == 1
    assert stats["consent"]["opted_out"] == {"tdm": 2}


@pytest.mark.parametrize("body", ["not json", '{"location": "/"}', "[1, {}, {\"x\": 1}]"])
def test_a_malformed_tdmrep_reserves_nothing(tmp_path, server, body):
    server.answer(TDMREP, body)
    rows, _ = _run(tmp_path, [server.url("/img/red.jpg")])
    assert _statuses(rows) == [("ok", None)]


def test_tdm_reservation_header_opts_out(tmp_path, server):
    server.answer("/tdm/red.jpg", (server.image_dir / "red.jpg").read_bytes(),
                  headers=[("tdm-reservation", "1")])
    server.answer("/tdm0/red.jpg", (server.image_dir / "red.jpg").read_bytes(),
                  headers=[("tdm-reservation", "0")])
    urls = [server.url("/tdm/red.jpg"), server.url("/tdm0/red.jpg")]
    rows, stats = _run(tmp_path, urls)
    assert _statuses(rows) == [("opted_out", "tdm"), ("ok", None)]
    assert rows[0]["error"].startswith("tdm-reservation: 1") and rows[0]["http_status"] == 200
    assert stats["consent"]["hosts"] == {f"127.0.0.1:{server.port}": {"tdm": 1}}
    rows, _ = _run(tmp_path / "off", urls[:1], run_id="off", tdm=False)
    assert _statuses(rows) == [("ok", None)]


def test_tdmrep_location_patterns():
    rules = parse_tdmrep(json.dumps([
        {"location": "/a/b$", "tdm-reservation": 1},
        {"location": "/a/*.jpg", "tdm-reservation": 0},
        {"location": "a/", "tdm-reservation": "1"},
        {"location": "", "tdm-reservation": 1}]))
    assert [r.location for r in rules] == ["/a/b$", "/a/*.jpg", "/a/"]
    assert reservation_for(rules, "/a/b").reserved
    assert not reservation_for(rules, "/a/x/y.jpg").reserved  # first match wins
    assert reservation_for(rules, "/a/b/c").reserved  # "/a/b$" does not match, "/a/" does
    assert reservation_for(rules, "/z") is None


# --------------------------------------------------------------------------- config, stats


def test_user_agent_token_is_replaced_by_user_agent():
    with pytest.raises(ConfigError, match="user_agent_token was replaced by download.user_"):
        parse_config({"input": {"path": "x"}, "output": {"path": "y"},
                      "download": {"user_agent_token": "me"}})
    with pytest.raises(ConfigError, match="product token"):
        parse_config({"input": {"path": "x"}, "output": {"path": "y"},
                      "download": {"user_agent": "/1.0 nobody"}})
    assert DownloadConfig(user_agent="my-bot/3 (+https://x.org)").agent_token == "my-bot"


def test_settings_record_robots_and_tdm_and_a_changed_token():
    base = {"input": {"path": "x"}, "output": {"path": "y"}}
    values = stage_settings(parse_config(base), "download")
    assert values["download.robots_txt"] is True and values["download.tdm"] is True
    assert "download.user_agent" not in values and "download.agent_token" not in values
    other = stage_settings(parse_config({**base, "download": {"user_agent": "Me/1 (+x)"}}),
                           "download")
    assert other["download.agent_token"] == "me"


def test_merged_stats_of_parts_add_up():
    parts = [{"opted_out": {"robots": 2}, "hosts": {"h": {"robots": 2}},
              "fetched": {ROBOTS: 1}, "origins": {"http://h": {"crawl_delay": 1.0}}},
             {"opted_out": {"robots": 1, "tdm": 1}, "hosts": {"h": {"tdm": 1}},
              "fetched": {}, "origins": {"http://h": {"crawl_delay": 1.0}}}]
    assert merge_stats(parts) == {
        "opted_out": {"robots": 3, "tdm": 1}, "hosts": {"h": {"robots": 2, "tdm": 1}},
        "fetched": {ROBOTS: 1}, "origins": {"http://h": {"crawl_delay": 1.0}}}
