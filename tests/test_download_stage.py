"""Stage 1 end to end: real loopback HTTP, real Ray, tars read back by webdataset and wids."""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import subprocess
import sys
import tarfile
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest
import webdataset as wds
import wids
from conftest import COCO_IMAGES
from loopback_server import LoopbackServer
from PIL import Image

from pairforge.config import ConfigError, PairforgeConfig, parse_config
from pairforge.download.shard import download_shard
from pairforge.pipeline.contract import shard_config
from pairforge.pipeline.download_stage import input_shards, run_download
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.settings import settings_record, stage_settings


@pytest.fixture(scope="module")
def servers():
    with (LoopbackServer(COCO_IMAGES) as good,
          LoopbackServer(COCO_IMAGES, host="127.0.0.2") as refused):
        yield good, refused


def _cases(good: LoopbackServer, refused: LoopbackServer) -> list[tuple[str, bytes, str]]:
    """(url, caption bytes, expected status) — one row per failure kind, plus ok rows."""
    img = "sample_5.jpg"
    return [
        (good.url(f"/img/{img}"), b"a photo", "ok"),
        (good.url("/status/404"), b"missing", "http_error"),
        (good.url(f"/flaky/f1?fail=1&name={img}"), b"flaky then fine", "ok"),
        (good.url(f"/retry-after/r1?secs=1&name={img}"), b"rate limited once", "ok"),
        (good.url("/slow?interval=0.3&size=64"), b"trickles", "timeout"),
        (good.url("/truncated/sample_10.jpg"), b"half a jpeg", "decode_error"),
        (good.url("/html"), b"a web page", "not_an_image"),
        (good.url("/big?size=300000"), b"too many bytes", "too_large"),
        (good.url("/bomb.png"), b"decompression bomb", "too_large"),
        (good.url("/redirect-loop"), b"loop", "too_many_redirects"),
        (good.url(f"/redirect-to?url={refused.url('/img/' + img)}"), b"to refused host",
         "blocked_address"),
        (refused.url(f"/img/{img}"), b"refused host", "blocked_address"),
        (good.url(f"/robots/noai/{img}"), b"opted out", "opted_out"),
        (good.url(f"/robots/otherbot: noai/{img}"), b"other agent's opt-out", "ok"),
        ("ftp://127.0.0.1/x.jpg", b"not http", "invalid_url"),
        (good.url(f"/img/{img}"), b"", "caption_invalid"),
        (good.url(f"/img/{img}"), b"caf\xe9 au lait", "caption_invalid"),
        (good.url("/img/sample_15.jpg"), b"another photo", "ok"),
        (good.url(f"/chunked/{img}"), b"chunked body", "ok"),
    ]


def _write_csv(path: Path, cases: list[tuple[str, bytes, str]]) -> None:
    lines = [b"url,caption,license"]
    lines += [url.encode() + b"," + cap + b",cc-by" for url, cap, _ in cases]
    path.write_bytes(b"\n".join(lines) + b"\n")


def _config(tmp_path: Path, inp: Path, **download):
    return parse_config({
        "input": {"path": str(inp), "shard_size": 8, "save_additional_columns": ["license"]},
        "output": {"path": str(tmp_path / "out")},
        "ray": {"num_cpus": 2},
        "download": {"threads": 4, "timeout": 1.0, "retries": 2, "backoff": 0.05,
                     "max_bytes": 200_000, "allow_addresses": ["127.0.0.1/32"],
                     "image": {"image_size": 64, "max_pixels": 10_000_000}, **download},
    })


def test_every_failure_kind_gets_its_status(tmp_path, servers, ray_local):
    good, refused = servers
    cases = _cases(good, refused)
    inp = tmp_path / "in.csv"
    _write_csv(inp, cases)
    # 2 s, not the 1 s of _config: the slow route still times out (it trickles for ~19 s),
    # and a redirect answered late on a loaded machine does not (one did, in the suite)
    summary = run_download(_config(tmp_path, inp, timeout=2.0), RunOptions(show_progress=False))

    raw = tmp_path / "out" / "raw"
    table = pq.read_table(sorted(raw.glob("*.parquet"))).to_pylist()
    assert [r["status"] for r in table] == [expected for _, _, expected in cases]
    assert [r["key"] for r in table] == [f"{i // 8:05d}{i % 8:04d}" for i in range(len(cases))]
    assert all(r["license"] == "cc-by" for r in table)
    assert all(r["error"] for r in table if r["status"] != "ok")
    # the funnel adds up per shard and overall
    stats = [json.loads(p.read_text()) for p in sorted(raw.glob("*_stats.json"))]
    assert [s["count"] for s in stats] == [8, 8, 3]
    assert sum(sum(s["status"].values()) for s in stats) == len(cases)
    assert summary["rows"] == len(cases)
    assert summary["status"] == dict(Counter(expected for _, _, expected in cases))
    # retried routes were hit twice; the refused host was never contacted at all
    assert good.hits("/flaky/f1") == 2 and good.hits("/retry-after/r1") == 2
    assert refused.requests_seen == 0
    _check_tars(raw, [r for r in table if r["status"] == "ok"])


def _check_tars(raw: Path, ok_rows: list[dict]) -> None:
    """Every ok row is one complete sample in the tars, readable by webdataset and wids."""
    tars = sorted(str(p) for p in raw.glob("*.tar"))
    samples = list(wds.WebDataset(tars, shardshuffle=False))
    assert [s["__key__"] for s in samples] == [r["key"] for r in ok_rows]
    for sample, row in zip(samples, ok_rows, strict=True):
        assert set(sample) >= {"__key__", "jpg", "txt", "json"}
        meta = json.loads(sample["json"])
        assert meta["sha256"] == row["sha256"] and int(meta["phash"], 16) == row["phash"]
        assert sample["txt"].decode() == row["caption"]
    index = [{"url": t, "nsamples": sum(1 for s in samples if s["__url__"] == t)} for t in tars]
    dataset = wids.ShardListDataset(index)
    assert len(dataset) == len(ok_rows)
    assert {dataset[i]["__key__"] for i in range(len(dataset))} == {r["key"] for r in ok_rows}


def _run_cli(cfg_path: Path, out: Path, *extra: str, env: dict[str, str] | None = None):
    cmd = [sys.executable, "-m", "pairforge.cli", "download", str(cfg_path), "-q",
           "--set", f"output.path={out}", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)


def _shard_contents(raw: Path) -> dict[str, tuple]:
    """key -> (status, sha256, image bytes, caption): what a reader of the shards gets."""
    rows = {r["key"]: r for r in pq.read_table(sorted(raw.glob("*.parquet"))).to_pylist()}
    images = {s["__key__"]: s["jpg"] for s in
              wds.WebDataset(sorted(str(p) for p in raw.glob("*.tar")), shardshuffle=False)}
    return {k: (r["status"], r["sha256"], images.get(k), r["caption"]) for k, r in rows.items()}


@pytest.mark.slow
def test_sigkill_then_rerun_equals_uninterrupted_run(tmp_path, servers, ray_env):
    import os
    import signal
    import time

    import yaml

    good, _ = servers
    names = sorted(p.name for p in COCO_IMAGES.glob("*.jpg"))[:120]
    inp = tmp_path / "in.csv"
    rows = [f"{good.url(f'/hold/{n}?secs=0.08')},photo {i}" for i, n in enumerate(names)]
    rows[7] = good.url("/status/404") + ",broken"
    inp.write_text("url,caption\n" + "\n".join(rows) + "\n")
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "input": {"path": str(inp), "shard_size": 10},
        "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
        "download": {"threads": 2, "processes": 2, "timeout": 5,
                     "allow_addresses": ["127.0.0.1/32"], "image": {"image_size": 64}}}))

    killed = tmp_path / "killed"
    proc = _run_cli(cfg_path, killed)
    deadline = time.monotonic() + 120
    while len(list((killed / "raw").glob("*_stats.json"))) < 3:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "download made no progress"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    complete_before = len(list((killed / "raw").glob("*_stats.json")))
    assert complete_before < 12, "the run finished before it could be killed"

    # the killed run had its own Ray, gone with it (its process group); the rerun and the
    # uninterrupted run join this worker's (conftest's ray_env: a Ray start less each)
    assert _run_cli(cfg_path, killed, env=ray_env).wait() == 0
    assert _run_cli(cfg_path, tmp_path / "whole", env=ray_env).wait() == 0

    raw = killed / "raw"
    tars = {p.stem for p in raw.glob("*.tar")}
    assert tars == {p.name.split("_")[0] for p in raw.glob("*_stats.json")}
    assert len(tars) == 12
    assert not [p for p in raw.iterdir() if ".tmp-" in p.name]
    assert _shard_contents(raw) == _shard_contents(tmp_path / "whole" / "raw")


def _tar_input(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w:gz" if path.suffix == ".gz" else "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("name", ["old.tar", "old.tar.gz"])
def test_existing_tar_is_reprocessed_without_network(tmp_path, name):
    """Rows of an existing WebDataset tar (plain or gzipped, any extension case) are read
    back from the tar by the shard task: resized, hashed and written like downloads."""
    photos = []
    for i, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        buffer = io.BytesIO()
        Image.new("RGB", (120 + i, 90), colour).save(buffer, "JPEG" if i else "PNG")
        photos.append(buffer.getvalue())
    _tar_input(tmp_path / name, [
        ("a/000.jpg", photos[1]), ("a/000.txt", b"green"),
        ("a/001.PNG", photos[0]), ("a/001.txt", b"red"), ("a/001.json", b"{}"),
        ("a/002.jpeg", photos[2]), ("a/002.txt", b"blue"), ("stray", b"no extension"),
    ])
    cfg = parse_config({"input": {"path": str(tmp_path / name), "shard_size": 10},
                        "output": {"path": str(tmp_path / "out")},
                        "download": {"threads": 2, "image": {"image_size": 64}}})
    with input_shards(cfg) as shards:
        stats = download_shard(shards[0], shard_config(cfg),
                               settings_record(stage_settings(cfg, "download")))
    assert stats["status"] == {"ok": 3}
    table = pq.read_table(tmp_path / "out" / "raw" / "00000.parquet").to_pylist()
    assert [r["caption"] for r in table] == ["green", "red", "blue"]
    assert [r["original_width"] for r in table] == [121, 120, 122]
    assert [r["height"] for r in table] == [64, 64, 64]
    assert [r["sha256"] for r in table] == [
        hashlib.sha256(p).hexdigest() for p in (photos[1], photos[0], photos[2])]


def _image_pass_peak(monkeypatch) -> dict[str, int]:  # noqa: ANN001
    """Counts the image passes running at once inside download_shard (``peak``)."""
    from pairforge.download import shard as download

    seen, lock = {"running": 0, "peak": 0}, threading.Lock()
    original = download.process_image

    def counted(body, cfg):  # noqa: ANN001, ANN202
        with lock:
            seen["running"] += 1
            seen["peak"] = max(seen["peak"], seen["running"])
        time.sleep(0.05)  # long enough for the other threads' fetches to finish meanwhile
        try:
            return original(body, cfg)
        finally:
            with lock:
                seen["running"] -= 1

    monkeypatch.setattr(download, "process_image", counted)
    return seen


def _photos_shard_config(tmp_path: Path, good: LoopbackServer, rows: int,
                         **download: object) -> PairforgeConfig:
    """One shard of ``rows`` COCO photos from ``good``, 8 fetch threads, 64 px output."""
    names = sorted(p.name for p in COCO_IMAGES.glob("*.jpg"))[:12]
    inp = tmp_path / "in.csv"
    _write_csv(inp, [(good.url(f"/img/{names[i % len(names)]}"), b"a photo", "ok")
                     for i in range(rows)])
    return parse_config({
        "input": {"path": str(inp), "shard_size": rows},
        "output": {"path": str(tmp_path / "out")},
        "download": {"threads": 8, "allow_addresses": ["127.0.0.1/32"],
                     "image": {"image_size": 64}, **download}})


def test_the_last_shard_split_over_the_slots_is_merged_into_the_same_shard(
        tmp_path, servers, ray_local):
    """3 shards on 2 slots: the third runs as two parts side by side (inputs.tail_parts)
    and is merged (raw.merge_parts) into the tar members, parquet rows and counts one task
    writes; no part file stays, and a stopped run's parts are removed before a rerun."""
    def run(out: str, **download: object) -> Path:
        cfg = _photos_shard_config(tmp_path, servers[0], 18, **download)
        cfg = cfg.model_copy(update={
            "input": cfg.input.model_copy(update={"shard_size": 6}),
            "output": cfg.output.model_copy(update={"path": str(tmp_path / out)})})
        run_download(cfg, RunOptions(show_progress=False))
        return tmp_path / out / "raw"

    whole, split = run("whole", processes=1), run("split", processes=2)
    for raw in (whole, split):
        assert sorted(p.name for p in raw.iterdir() if p.name.startswith("00002")) == [
            "00002.parquet", "00002.tar", "00002_stats.json"]
    assert _members(whole / "00002.tar") == _members(split / "00002.tar")
    assert len(_members(split / "00002.tar")) == 18  # 6 samples x jpg, json, txt
    assert pq.read_table(whole / "00002.parquet").equals(pq.read_table(split / "00002.parquet"))
    merged = json.loads((split / "00002_stats.json").read_text())
    alone = json.loads((whole / "00002_stats.json").read_text())
    assert merged["parts"] == 2 and "parts" not in alone
    assert {k: merged[k] for k in ("count", "successes", "status", "shard")} == \
        {k: alone[k] for k in ("count", "successes", "status", "shard")}
    assert "parts" not in json.loads((split / "00001_stats.json").read_text())

    (split / "00002_stats.json").unlink()  # as if stopped between parts and merge
    (split / "00002.part1of2.tar").write_bytes(b"half")
    run("split", processes=2)
    assert not list(split.glob("*.part*"))
    assert _members(split / "00002.tar") == _members(whole / "00002.tar")


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


@pytest.mark.parametrize("image_threads", [1, 3])
def test_image_pass_runs_at_most_image_threads_at_once(tmp_path, servers, monkeypatch,
                                                      image_threads):
    """Of a task's fetch threads, only download.image_threads run the image pass at once
    (download.py: more cost CPU in cache misses); the others keep fetching."""
    seen = _image_pass_peak(monkeypatch)
    cfg = _photos_shard_config(tmp_path, servers[0], 24, image_threads=image_threads)
    with input_shards(cfg) as shards:
        stats = download_shard(shards[0], shard_config(cfg),
                               settings_record(stage_settings(cfg, "download")))
    assert stats["status"] == {"ok": 24}
    assert seen["peak"] == image_threads


@pytest.mark.parametrize(("slots", "cores", "expected"), [(3, 8, 3), (3, 2, 2), (1, 8, 1)])
def test_image_pass_widens_to_the_slots_the_runner_answers(tmp_path, servers, monkeypatch,
                                                           slots, cores, expected):
    """In the run's tail the progress report answers with more task slots; the image pass
    widens to slots x image_threads, within the node's cores."""
    from pairforge.download import shard as download

    seen = _image_pass_peak(monkeypatch)
    monkeypatch.setattr(download, "usable_cores", lambda: cores)
    cfg = _photos_shard_config(tmp_path, servers[0], 40)
    reports: list[int] = []

    def progress(counts: Counter) -> int:
        reports.append(sum(counts.values()))
        return slots

    with input_shards(cfg) as shards:
        settings = settings_record(stage_settings(cfg, "download"))
        stats = download_shard(shards[0], shard_config(cfg), settings, progress=progress)
    assert stats["status"] == {"ok": 40}
    assert sum(reports) == 40 and len(reports) >= 2  # widened before the last rows
    assert seen["peak"] == expected


def test_runner_hands_finished_tasks_slots_to_the_running_ones(ray_local):
    """Through real Ray: once no task waits, the counter actor answers a running task's
    report with the slots the finished ones left (slots_per_task)."""
    import ray

    from pairforge.pipeline.counter import ProgressCounter
    from pairforge.pipeline.executors import run_bounded, slots_per_task

    assert [slots_per_task(2, 3, 2), slots_per_task(2, 0, 1), slots_per_task(16, 0, 5),
            slots_per_task(16, 0, 0), slots_per_task(4, 1, 3)] == [1, 2, 3, 1, 1]

    @ray.remote(num_cpus=1)
    def task(item: str, counter) -> tuple[str, list[int]]:  # noqa: ANN001
        answers = [ray.get(counter.add.remote({"ok": 1}))]
        deadline = time.monotonic() + 30
        while item == "slow" and answers[-1] == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            answers.append(ray.get(counter.add.remote({})))
        return item, answers

    counter = ray.remote(num_cpus=0)(ProgressCounter).remote()
    results: list[tuple[str, list[int]]] = []
    run_bounded(["slow", "fast", "fast"], lambda item: task.remote(item, counter), 2,
                on_tick=lambda finished: None, on_result=results.append,
                on_slots=counter.share.remote)
    # Each "fast" reported while the other one waited or ran beside "slow": one slot;
    # "slow" ran on alone and was answered with the two.
    assert sorted(results) == [("fast", [1]), ("fast", [1]), ("slow", results[-1][1])]
    assert results[-1][0] == "slow" and results[-1][1][-1] == 2
    assert ray.get(counter.total.remote()) == {"ok": 3}
    ray.kill(counter)


def _raylet_workers(raylet: int) -> list[str]:
    """Command lines of the raylet's worker processes (its two agents left out)."""
    from pathlib import Path  # again: a subprocess runs this function's source alone

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):  # a process that ended while we looked
            continue
        if parent == raylet and "agent" not in command.lower():
            found.append(command)
    return found


def test_a_driver_starts_and_leaves_ray_without_needless_waits(tmp_path):
    """Stages 1 and 2 never build a Ray Data dataset, so their driver does not pay the
    ~0.5 s of importing it (stage 3 quiets Ray Data where it builds one), nor pandas' 0.1 s
    for reading a parquet input; no worker process is started before a task asks for one
    (``ray_private.worker_settings``); at exit, ``init_ray``'s hook leaves Ray once (however often
    Ray was started) before Ray's own hook would sleep 0.5 s first."""
    table = tmp_path / "input.parquet"
    pq.write_table(pa.table({"url": ["http://127.0.0.1/a.jpg"]}), table)
    script = ("import atexit, sys, time\n"
              "def report():  # registered first, so it runs after every later hook\n"
              "    import ray\n"
              "    print(calls, sleeps, ray.is_initialized())\n"
              "atexit.register(report)\n"
              "import fsspec, ray\n"
              "from ray._private import worker\n"
              "from pairforge.config import RayConfig\n"
              "from pairforge.pipeline.ray_runtime import init_ray\n"
              "from pairforge.tables import read_table_file\n"
              f"rows = read_table_file(fsspec.filesystem('file'), {str(table)!r}, 'parquet')\n"
              "init_ray(RayConfig(num_cpus=1, object_store_memory=100 * 1024**2))\n"
              "init_ray(RayConfig(num_cpus=1))\n"
              "print('ray.data' in sys.modules, 'pandas' in sys.modules, rows.num_rows)\n"
              "raylet = worker._global_node.all_processes['raylet'][0].process.pid\n"
              "print(len(_raylet_workers(raylet)))\n"
              "calls, sleeps, shutdown = [], [], ray.shutdown\n"
              "ray.shutdown = lambda *a, **k: calls.append(1) or shutdown(*a, **k)\n"
              "worker.time = type('Clock', (), {'sleep': staticmethod(sleeps.append),\n"
              "                                 'time': staticmethod(time.time)})\n")
    helper = inspect.getsource(_raylet_workers)
    done = subprocess.run([sys.executable, "-c", helper + script], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False False 1", "0", "[1] [] False"]


# -- planning from metadata: each shard task reads its own rows (download/inputs.py)

QUIET = RunOptions(show_progress=False)


def _refused_rows(start: int, stop: int) -> pa.Table:
    """Rows the address guard refuses before any request (127.0.0.2 is not allowed)."""
    return pa.table({"url": [f"http://127.0.0.2:9/{i}.jpg" for i in range(start, stop)],
                     "caption": [f"row {i}" for i in range(start, stop)]})


def _refused_config(tmp_path: Path, inp: object, shard_size: int = 10) -> PairforgeConfig:
    return parse_config({
        "input": {"path": inp, "shard_size": shard_size},
        "output": {"path": str(tmp_path / "out")},
        "ray": {"num_cpus": 2},
        "download": {"threads": 4, "allow_addresses": ["127.0.0.1/32"]}})


def _raw_rows(out: Path) -> list[dict]:
    raw = out / "raw"
    complete = sorted(p.name.split("_")[0] for p in raw.glob("*_stats.json"))
    return pq.read_table([raw / f"{name}.parquet" for name in complete]).to_pylist()


def test_a_corrupt_parquet_stops_the_run_naming_it_and_the_rerun_loses_no_row(
        tmp_path, ray_local):
    """Shards reading a parquet file with corrupt pages fail with a message naming it;
    once it is replaced, the rerun completes the rest: every input row once, under
    today's keys."""
    paths = [tmp_path / f"part-{i}.parquet" for i in range(3)]
    for i, path in enumerate(paths):
        pq.write_table(_refused_rows(i * 25, i * 25 + 25), path)
    good = paths[1].read_bytes()
    damaged = bytearray(good)
    damaged[4:300] = b"\xab" * 296  # the first page header; the footer stays readable
    paths[1].write_bytes(bytes(damaged))
    cfg = _refused_config(tmp_path, str(tmp_path / "part-*.parquet"))
    with pytest.raises(ConfigError, match=r"cannot read rows \d+-\d+ of input "
                                          r"'.*part-1\.parquet'"):
        run_download(cfg, RunOptions(show_progress=False))
    assert not list((tmp_path / "out" / "raw").glob("0000[234][._]*"))  # rows of part-1

    paths[1].write_bytes(good)
    summary = run_download(cfg, RunOptions(show_progress=False))
    rows = _raw_rows(tmp_path / "out")
    assert summary["rows"] == 75 and summary["status"] == {"blocked_address": 75}
    assert [r["url"] for r in rows] == _refused_rows(0, 75)["url"].to_pylist()
    assert [r["key"] for r in rows] == [f"{i // 10:05d}{i % 10:04d}" for i in range(75)]


def test_a_ragged_csv_row_stops_the_split_naming_the_file(tmp_path, ray_local, monkeypatch):
    from pairforge.pipeline import download_stage as runner

    monkeypatch.setattr(runner, "SPLIT_HERE_BYTES", 0)  # split in a Ray task: its error
    good, bad = tmp_path / "a.csv", tmp_path / "b.csv"
    good.write_text("url,caption\nhttp://127.0.0.2:9/0.jpg,zero\n")
    bad.write_text("url,caption\nhttp://127.0.0.2:9/1.jpg,one\nhttp://127.0.0.2:9/2.jpg\n")
    with pytest.raises(ConfigError, match=r"cannot parse input '.*b\.csv' as csv: CSV parse "
                                          r"error: (Row #3: )?Expected 2 columns, got 1"):
        run_download(_refused_config(tmp_path, [str(good), str(bad)]), QUIET)
    assert not list((tmp_path / "out" / "raw").glob("*.parquet"))


def test_an_input_gone_after_planning_fails_its_shards_naming_it(tmp_path, ray_local,
                                                                 monkeypatch):
    from pairforge.pipeline import download_stage as runner

    paths = [tmp_path / f"{name}.parquet" for name in "ab"]
    pq.write_table(_refused_rows(0, 15), paths[0])
    pq.write_table(_refused_rows(15, 30), paths[1])
    planned = runner.plan_input

    def plan_then_delete(*args):  # noqa: ANN002, ANN202
        shards = planned(*args)
        paths[1].unlink()
        return shards

    monkeypatch.setattr(runner, "plan_input", plan_then_delete)
    with pytest.raises(ConfigError, match=r"input '.*b\.parquet': FileNotFoundError"):
        run_download(_refused_config(tmp_path, [str(p) for p in paths]), QUIET)


@pytest.mark.parametrize("name", ["in.csv", "in.parquet"])
def test_missing_columns_stop_the_run_before_ray(tmp_path, monkeypatch, name):
    from pairforge.pipeline import download_stage as runner

    def no_ray(*_):  # noqa: ANN002, ANN202
        raise AssertionError("Ray was started")

    monkeypatch.setattr(runner, "init_ray", no_ray)
    path = tmp_path / name
    table = _refused_rows(0, 3).rename_columns(["URL", "caption"])
    if name.endswith(".csv"):
        pa.csv.write_csv(table, path)
    else:
        pq.write_table(table, path)
    with pytest.raises(ConfigError, match=rf"input '.*{name}' has no column 'url'"):
        run_download(_refused_config(tmp_path, str(path)), RunOptions(show_progress=False))


@pytest.mark.parametrize("on_ray", [True, False])
def test_csv_input_is_split_once_and_read_by_the_shard_tasks(tmp_path, ray_local, monkeypatch,
                                                             on_ray):
    """The splitting pass writes the csv as parquet under OUT/inputs (in Ray tasks, or in
    the driver for small inputs); a rerun (the raw shards redone here) reuses it, and both
    runs give the rows the csv holds, in order."""
    import gzip

    from pairforge.pipeline import download_stage as runner

    on_ray_calls = []
    split_on_ray = runner._split_on_ray
    monkeypatch.setattr(runner, "_split_on_ray",
                        lambda *args: on_ray_calls.append(1) or split_on_ray(*args))
    if on_ray:
        monkeypatch.setattr(runner, "SPLIT_HERE_BYTES", 0)

    path = tmp_path / "in.csv.gz"
    table = _refused_rows(0, 23)
    buffer = io.BytesIO()
    pa.csv.write_csv(table, buffer)
    path.write_bytes(gzip.compress(buffer.getvalue()))
    cfg = _refused_config(tmp_path, str(path), shard_size=5)
    run_download(cfg, RunOptions(show_progress=False))
    split = list((tmp_path / "out" / "inputs").iterdir())
    assert len(split) == 1 and pq.ParquetFile(split[0]).metadata.num_row_groups == 5
    made = split[0].stat().st_mtime_ns
    first = _raw_rows(tmp_path / "out")
    for stats in (tmp_path / "out" / "raw").glob("*_stats.json"):
        stats.unlink()
    run_download(cfg, RunOptions(show_progress=False))
    assert split[0].stat().st_mtime_ns == made
    again = _raw_rows(tmp_path / "out")
    assert [r["url"] for r in again] == [r["url"] for r in first] == table["url"].to_pylist()
    assert [r["caption"] for r in again] == table["caption"].to_pylist()
    assert len(on_ray_calls) == on_ray  # the first run only
