"""Opt-out lists and block lists (download/lists.py): what they match, their errors, and
stage 1 with them over loopback HTTP on real Ray: opted-out URLs are never requested,
blocked images are never written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import COCO_IMAGES
from loopback_server import LoopbackServer

from pairforge.config import BlockListConfig, ConfigError, DownloadConfig, parse_config
from pairforge.download.imageproc import process_image
from pairforge.download.lists import (
    BlockList,
    OptOutList,
    PhashSet,
    list_fingerprints,
    load_lists,
)


def _file(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_opt_out_entries_match_domains_urls_and_prefixes(tmp_path):
    lists = OptOutList.load([_file(tmp_path / "a.txt", [
        "# a comment, then a blank line", "", "Example.COM", "https://cdn.net/a/b.jpg",
        "http://photos.org/private/*   # trailing comment",
        "https://site.org/folder/", "https://site.org/page?x=/"])], {})
    assert len(lists) == 5
    for url in ("http://example.com/x.jpg", "https://img.example.com/y.png",
                "https://EXAMPLE.com./z", "https://cdn.net/a/b.jpg", "HTTPS://CDN.NET/a/b.jpg",
                "http://photos.org/private/", "http://photos.org/private/deep/1.jpg",
                # a line ending in / is a folder, as in robots.txt: it and all under it
                "https://site.org/folder/", "https://site.org/folder/a.jpg",
                "https://SITE.org/folder/deep/b.png?size=2", "https://site.org/page?x=/"):
        assert lists.matches(url), url
    for url in ("http://notexample.com/x.jpg", "http://example.co/x", "https://cdn.net/a/b.jpgx",
                "https://cdn.net/a/B.jpg", "http://photos.org/privat", "https://photos.org/private/x",
                "ftp://example.com/x", "not a url", "https://site.org/folder",
                "https://site.org/folderx/a.jpg", "http://site.org/folder/a.jpg",
                "https://site.org/page?x=/y"):
        assert not lists.matches(url), url


def test_how_an_opt_out_line_reads_is_in_the_settings_fingerprint(tmp_path):
    """Folder lines became prefixes (issue 52): shards made under the old reading of the
    same file must not pass as made under these settings."""
    path = _file(tmp_path / "l.txt", ["ab" * 32])
    as_opt_out = list_fingerprints(DownloadConfig(opt_out_lists=[path]), {})
    as_block = list_fingerprints(DownloadConfig(
        block_lists=[BlockListConfig(path=path, kind="sha256")]), {})
    assert as_opt_out.keys() == as_block.keys() and as_opt_out != as_block


def test_a_list_line_that_does_not_parse_is_named_by_file_and_line(tmp_path):
    path = _file(tmp_path / "bad.txt", ["example.com", "", "http:///no-host.jpg"])
    with pytest.raises(ConfigError, match=r"bad\.txt:3: 'http:///no-host\.jpg' is not an http"):
        OptOutList.load([path], {})
    path = _file(tmp_path / "bad2.txt", ["exa mple.com"])
    with pytest.raises(ConfigError, match=r"bad2\.txt:1: .* neither a domain"):
        OptOutList.load([path], {})
    sha = _file(tmp_path / "sha.txt", ["ab" * 32, "ab" * 20])
    with pytest.raises(ConfigError, match=r"sha\.txt:2: a sha256 is 64 hex digits"):
        BlockList.load([BlockListConfig(path=sha, kind="sha256")], {})
    with pytest.raises(ConfigError, match="cannot read the list file"):
        OptOutList.load([str(tmp_path / "missing.txt")], {})
    with pytest.raises(ValueError, match="max_distance is for kind phash"):
        BlockListConfig(path=sha, kind="sha256", max_distance=2)


def test_phash_matches_within_the_distance_exactly_as_a_bare_loop():
    rng = np.random.default_rng(3)
    listed = rng.integers(0, 2**63, 5_000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    queries = np.concatenate([listed[:300] ^ (np.uint64(1) << rng.integers(0, 64, 300).astype(
        np.uint64)), listed[300:600] ^ np.uint64(0b1011_0000_0001), rng.integers(
        0, 2**63, 400, dtype=np.uint64)])
    for distance in (0, 1, 3, 4):
        found = PhashSet(listed, distance)
        expected = [int(np.bitwise_count(listed ^ q).min()) <= distance for q in queries]
        assert [int(q) in found for q in queries] == expected
        # 300 one bit away, 300 four bits away, 400 random (none within 4 bits)
        assert sum(expected) == {0: 0, 1: 300, 3: 300, 4: 600}[distance]


def _served(tmp_path: Path) -> tuple[Path, list[Path]]:
    photos = sorted(COCO_IMAGES.iterdir())[:8]
    folder = tmp_path / "served"
    (folder / "private").mkdir(parents=True)
    for photo in photos[:6]:
        (folder / photo.name).write_bytes(photo.read_bytes())
    for photo in photos[6:]:
        (folder / "private" / photo.name).write_bytes(photo.read_bytes())
    return folder, photos


def test_stage1_never_requests_opted_out_urls_and_never_writes_blocked_images(
        tmp_path, ray_local):
    import webdataset as wds

    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.entry import RunOptions

    folder, photos = _served(tmp_path)
    # the hashes as stage 1 computes them at this run's settings (JPEG decodes at a scale
    # that depends on the target size)
    image_cfg = parse_config({"input": {"path": "x"}, "output": {"path": "y"},
                              "download": {"image": {"image_size": 64}}}).download.image
    hashed = [process_image(p.read_bytes(), image_cfg) for p in photos[:3]]
    with LoopbackServer(folder, "127.0.0.1") as server:
        urls = [server.url(f"/img/{p.name}") for p in photos[:6]]
        urls += [server.url(f"/img/private/{p.name}") for p in photos[6:]]
        urls.append(server.url("/robots/noai/" + photos[5].name))
        (tmp_path / "in.csv").write_text("url,caption\n" + "".join(
            f"{u},a photo {i}\n" for i, u in enumerate(urls)))
        blocks = {"sha256": [hashlib.sha256(photos[0].read_bytes()).hexdigest()],
                  "pixel_hash": [hashed[1].pixel_hash],
                  "phash": [f"{hashed[2].phash ^ 0b101:016x}"]}  # 2 bits away
        cfg = parse_config({
            "input": {"path": str(tmp_path / "in.csv"), "shard_size": 5},
            "output": {"path": str(tmp_path / "out")},
            "download": {"threads": 4, "allow_addresses": ["127.0.0.1/32"],
                         "image": {"image_size": 64},
                         "opt_out_lists": [_file(tmp_path / "optout.txt", [
                             urls[4], server.url("/img/private/") + "*"])],
                         "block_lists": [
                             {"path": _file(tmp_path / f"{kind}.txt", hashes), "kind": kind,
                              "max_distance": 2 if kind == "phash" else 0}
                             for kind, hashes in blocks.items()]}})
        summary = run_download(cfg, RunOptions(show_progress=False))
        requested = {p.name: server.hits(f"/img/{p.name}") for p in photos[:6]}
        private = [server.hits(f"/img/private/{p.name}") for p in photos[6:]]
    assert private == [0, 0] and requested[photos[4].name] == 0  # never requested
    assert [requested[p.name] for p in photos[:4]] == [1, 1, 1, 1]
    rows = {r["url"]: r for f in sorted((tmp_path / "out" / "raw").glob("*.parquet"))
            for r in pq.read_table(f).to_pylist()}
    assert [rows[u]["status"] for u in urls] == [
        "blocked", "blocked", "blocked", "ok", "opted_out", "ok", "opted_out", "opted_out",
        "opted_out"]
    assert [rows[u]["opt_out_reason"] for u in urls] == [None] * 4 + ["list", None] + [
        "list", "list", "x_robots_tag"]
    assert [rows[u]["error"] for u in urls[:3]] == [
        f"its {kind} is on a block list (download.block_lists)" for kind in blocks]
    assert all(rows[u]["sha256"] is None and rows[u]["phash"] is None for u in urls[:3])
    assert summary["status"] == {"ok": 2, "blocked": 3, "opted_out": 4}
    written = {s["__key__"] for f in sorted((tmp_path / "out" / "raw").glob("*.tar"))
               for s in wds.WebDataset(str(f), shardshuffle=False)}
    assert written == {rows[urls[3]]["key"], rows[urls[5]]["key"]}


def test_a_bad_list_stops_the_run_before_any_request(tmp_path, ray_local):
    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.entry import RunOptions

    folder, photos = _served(tmp_path)
    with LoopbackServer(folder, "127.0.0.1") as server:
        (tmp_path / "in.csv").write_text(f"url,caption\n{server.url('/img/' + photos[0].name)},"
                                         "a photo\n")
        bad = _file(tmp_path / "p.txt", ["0" * 15])
        cfg = parse_config({"input": {"path": str(tmp_path / "in.csv")},
                            "output": {"path": str(tmp_path / "out")},
                            "download": {"allow_addresses": ["127.0.0.1/32"],
                                         "block_lists": [{"path": bad, "kind": "phash"}]}})
        with pytest.raises(ConfigError, match=r"p\.txt:1: a phash is 16 hex digits"):
            run_download(cfg, RunOptions(show_progress=False))
        assert server.hits(f"/img/{photos[0].name}") == 0
    assert not list((tmp_path / "out" / "raw").glob("*.tar"))


def test_no_lists_load_nothing_and_a_changed_list_changes_the_settings(tmp_path):
    from pairforge.pipeline.settings import stage_settings

    base = {"input": {"path": "x"}, "output": {"path": "y"}}
    cfg = parse_config(base)
    assert load_lists(cfg.download, {}) is None
    plain = stage_settings(cfg, "download")
    assert not any("list" in k for k in plain)  # earlier builds keep their digest
    path = _file(tmp_path / "o.txt", ["example.com"])
    listed = parse_config({**base, "download": {"opt_out_lists": [path]}})
    first = stage_settings(listed, "download")
    _file(tmp_path / "o.txt", ["example.org"])
    assert stage_settings(listed, "download") != first != plain
