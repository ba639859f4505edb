"""`pairforge build` on a real three-node Ray cluster (one machine, loopback), and losing a
node in the middle of a build.

The nodes are separate `ray start` processes (tests/cluster_utils.py, fixture
`ray_cluster`). Placement is read from Ray's own records in the GCS (task events, actor
table). The tokenize pool asks for the custom resource `gpu_like`, which only the node
"gpu" has, as a GPU pool asks for GPUs. The reference build (`s3_cluster_build`) reads and
writes S3; the node-loss build writes to local disk, so the comparison also shows that the
storage does not change the result.
"""

from __future__ import annotations

import io
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import host_node_loss
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from cluster_utils import finish, start_build
from conftest import CLUSTER_IMAGES, CLUSTER_SHARD_SIZE

pytestmark = pytest.mark.slow


def result_of(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What must not depend on how the build ran: rows, statuses, tasks, token totals."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.invalidate_cache()
    rows = []
    for path in sorted(fs.glob(f"{root}/shards/*.parquet")):
        with fs.open(path, "rb") as f:
            rows += pq.read_table(f, columns=["key", "status", "task", "n_image_tokens",
                                              "n_caption_tokens"]).to_pylist()
    manifest = json.loads(fs.cat(f"{root}/manifest.json"))
    return {"rows": sorted((r["key"], r["status"], r["task"], r["n_image_tokens"],
                            r["n_caption_tokens"]) for r in rows),
            "tasks": manifest["totals"]["tasks"],
            "shards": [(s["name"], s["samples"], s["rows"]) for s in manifest["shards"]],
            "funnel": manifest["funnel"]}


def leftovers(out: Path) -> list[str]:
    return [str(p) for p in out.rglob("*") if ".tmp-" in p.name]


def finish_or_rerun(cluster: Any, proc: Any, cfg: dict[str, Any], folder: Path) -> int:
    """Wait for the build; if Ray could not recover, a rerun must complete it. Returns
    the number of reruns (0 or 1)."""
    done = finish(proc)
    reruns = int(done.returncode != 0)
    if reruns:
        done = finish(start_build(cluster, cfg, folder))
    assert done.returncode == 0, done.stderr[-4000:]
    return reruns


def test_build_runs_across_the_nodes(ray_cluster, s3_cluster_build):
    build = s3_cluster_build
    nodes = {n.node_id: name for name, n in ray_cluster.started.items()}
    downloads = [t for t in build["tasks"] if t["name"] == "_download_task"]
    assert len(downloads) == CLUSTER_IMAGES // CLUSTER_SHARD_SIZE
    # One CPU per node, one download task per CPU: every node downloaded shards.
    assert {nodes[t["node"]] for t in downloads} == {"head", "gpu", "cpu"}
    # Stage 2 (hash reads) and stage 3 (the shard writer) ran as cluster tasks too.
    names = {t["name"] for t in build["tasks"]}
    assert {"read_hash_columns", "write_shard_task"} <= names, names
    # The tokenize pool asked for `gpu_like`: Ray placed its actors on "gpu" only.
    pool = [a for a in build["actors"] if "TokenizeStep" in a["class"]]
    assert pool and {nodes[a["node"]] for a in pool} == {"gpu"}, build["actors"]
    # The progress counter lives beside the driver, so no worker node can take it down.
    counters = [a for a in build["actors"] if a["class"] == "ProgressCounter"]
    assert counters and {nodes[a["node"]] for a in counters} == {"head"}
    print(f"reference build on 3 nodes, S3 in and out: {build['seconds']:.0f} s")


def test_losing_a_node_mid_build_gives_the_same_output(ray_cluster, s3_cluster_build,
                                                       tmp_path):
    """SIGKILL node "cpu" (its `ray start`, raylet, agents, workers) while it downloads a
    shard. Ray retries the lost task elsewhere; if it could not, a rerun must finish the
    build. Either way the output equals the uninterrupted build's. The node stays dead:
    later users of `ray_cluster` get head and "gpu"."""
    reference = s3_cluster_build
    cfg = {**reference["cfg"], "output": {"path": str(tmp_path / "out")}}
    proc = start_build(ray_cluster, cfg, tmp_path / "run")
    try:
        deadline = time.monotonic() + 300
        while not ray_cluster.running("cpu", "ray::_download_task"):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "no download task ever ran on node cpu"
            time.sleep(0.1)
        time.sleep(1.0)  # mid-shard: some images fetched, the tar half written
        killed_mid_task = ray_cluster.running("cpu", "ray::_download_task")
        ray_cluster.started["cpu"].kill()
        reruns = finish_or_rerun(ray_cluster, proc, cfg, tmp_path / "run")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_mid_task
    assert result_of(str(tmp_path / "out")) == result_of(
        reference["out"], reference["cfg"]["output"]["storage_options"])
    assert leftovers(tmp_path / "out") == []
    placement = ray_cluster.placement()
    jobs = {t["job"] for t in placement["tasks"] if t["name"] == "_download_task"}
    downloads = [t for t in placement["tasks"] if t["name"] == "_download_task"
                 and t["job"] in jobs - {reference["job"]}]
    cpu = ray_cluster.started["cpu"].node_id
    assert any(t["node"] == cpu for t in downloads)  # the node had work when it died
    # Ray retried the attempt that died with the node (or the rerun redid the shard).
    assert reruns or any(t["attempt"] > 0 for t in downloads), downloads
    print(f"node lost mid-build: recovered {'by a rerun' if reruns else 'by Ray retries'}")


def test_losing_the_model_node_mid_stage_3_gives_the_same_output(ray_cluster, s3_cluster_build,
                                                                 tmp_path):
    """SIGKILL node "gpu", the only one the tokenize pool may use, once its actors are up
    in stage 3, and bring it back, as a preempted GPU node is replaced. Ray Data restarts
    the pool's actors on the node that came back and retries their tasks; if it could not,
    a rerun must finish the build. Either way the output equals the uninterrupted build's,
    with no partial file."""
    reference = s3_cluster_build
    cfg = {**reference["cfg"], "output": {"path": str(tmp_path / "out")}}
    jobs_before = _jobs(ray_cluster.placement())
    proc = start_build(ray_cluster, cfg, tmp_path / "run")
    pool = "ray::MapWorker(MapBatches(TokenizeStep))"
    try:
        deadline = time.monotonic() + 300
        while not ray_cluster.running("gpu", pool):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the tokenize pool never started on node gpu"
            time.sleep(0.05)
        assert not (tmp_path / "out" / "manifest.json").exists()  # stage 3 is not done
        ray_cluster.started["gpu"].kill()
        ray_cluster.wait_dead("gpu")
        ray_cluster.restart("gpu")
        reruns = finish_or_rerun(ray_cluster, proc, cfg, tmp_path / "run")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result_of(str(tmp_path / "out")) == result_of(
        reference["out"], reference["cfg"]["output"]["storage_options"])
    assert leftovers(tmp_path / "out") == []
    placement = ray_cluster.placement()
    [job, *rerun_jobs] = sorted(_jobs(placement) - jobs_before)
    assert len(rerun_jobs) == reruns
    if not reruns:  # the pool the build finished with lived on the node that came back
        actors = [a for a in placement["actors"]
                  if a["job"] == job and "TokenizeStep" in a["class"]]
        assert actors and {a["node"] for a in actors} == {ray_cluster.started["gpu"].node_id}
    print(f"model node lost in stage 3: recovered {'by a rerun' if reruns else 'by Ray'}")


def _jobs(placement: dict[str, list[dict[str, Any]]]) -> set[str]:
    return {t["job"] for t in placement["tasks"]} | {a["job"] for a in placement["actors"]}


# ------------------------------------------------ the reference build went through S3

def _pipe_url(url: str, storage_options: dict[str, Any]) -> str:
    """A webdataset ``pipe:`` URL that streams one object through fsspec."""
    code = ("import fsspec, json, shutil, sys; "
            "f = fsspec.open(sys.argv[1], 'rb', **json.loads(sys.argv[2])).open(); "
            "shutil.copyfileobj(f, sys.stdout.buffer)")
    return "pipe:" + " ".join(shlex.quote(a) for a in
                              [sys.executable, "-c", code, url, json.dumps(storage_options)])


def test_build_reads_and_writes_s3(s3_server, s3_cluster_build, monkeypatch):
    """The whole build went through S3: input list, raw shards, dedup tables, training
    shards, stats, manifest; nothing local, nothing temporary; webdataset reads it back."""
    for name, value in s3_server.env.items():  # this process reads S3: moto only, never AWS
        monkeypatch.setenv(name, value)
    bucket, opts = s3_cluster_build["bucket"], s3_server.storage_options
    assert sorted(p.name for p in (s3_cluster_build["folder"] / "run").iterdir()) == [
        "build.yaml"]  # the driver wrote nothing to local disk
    fs = fsspec.filesystem("s3", **opts)
    fs.invalidate_cache()
    keys = {k.split("/out/", 1)[1] for k in fs.find(f"{bucket}/out")}
    for i in range(CLUSTER_IMAGES // CLUSTER_SHARD_SIZE):
        for folder in ("raw", "shards"):
            assert {f"{folder}/{i:05d}.tar", f"{folder}/{i:05d}.parquet",
                    f"{folder}/{i:05d}_stats.json"} <= keys
    assert {"dedup/duplicates.parquet", "dedup/index.parquet/part-0.parquet",
            "dedup/dedup_stats.json", "manifest.json", "sizes.json", "index.wids.json"} <= keys
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


def test_losing_a_node_mid_stage_1_keeps_the_host_coordinator_and_loses_no_row(ray_cluster,
                                                                               tmp_path):
    """Issue 52's node fault, on this file's cluster (tests/host_node_loss.py)."""
    host_node_loss.losing_a_node_mid_run(ray_cluster, tmp_path)
