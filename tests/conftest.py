"""Shared fixtures: real images on disk and loopback HTTP servers (see loopback_server.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_utils import (
    LocalCluster,
    MotoServer,
    build_config,
    finish,
    start_build,
    write_coco_input,
)
from loopback_server import LoopbackServer, make_images


@pytest.fixture(scope="session")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of small real images: red.jpg, blue.png, green.webp."""
    directory = tmp_path_factory.mktemp("images")
    make_images(directory)
    return directory


@pytest.fixture
def http_server(image_dir: Path) -> Iterator[LoopbackServer]:
    """A keep-alive test server on 127.0.0.1 (the address tests allow-list)."""
    with LoopbackServer(image_dir, "127.0.0.1") as server:
        yield server


@pytest.fixture
def refused_server(image_dir: Path) -> Iterator[LoopbackServer]:
    """A server on 127.0.0.2, outside the allow-list: it must never receive a request."""
    with LoopbackServer(image_dir, "127.0.0.2") as server:
        yield server


# 160 real MS-COCO photos (<= 300 px) and their captions, kept in the repository so that a
# fresh clone passes its tests; tests/data/README.md says where they come from. Every test
# that needs real photos takes them from here.
COCO_DIR = Path(__file__).resolve().parent / "data" / "coco"
COCO_IMAGES = COCO_DIR / "images"
COCO_CAPTIONS = COCO_DIR / "captions.csv"


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """One local Ray instance for the in-process stage tests (starting Ray costs seconds)."""
    import ray

    from pairforge.config import RayConfig
    from pairforge.pipeline.ray_runtime import init_ray

    init_ray(RayConfig(num_cpus=2, object_store_memory=300 * 1024**2))
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_env(ray_local: None) -> dict[str, str]:
    """The environment for a `pairforge` subprocess that joins this worker's Ray
    (``ray_local``, through RAY_ADDRESS, which ``init_ray`` joins) instead of starting and
    stopping one of its own: a local start costs seconds, many under load. For tests where
    starting Ray is not what they check; a test of a user's fresh start runs without it.
    The worker's Ray listens on loopback only, which ``init_ray`` joins as such
    (ray_private's ``joining``)."""
    import ray

    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


@pytest.fixture(scope="module")
def ablation() -> Any:
    """bench/ablation.py as a module (the ablation tests check its plan and configs)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "ablation.py"
    spec = importlib.util.spec_from_file_location("ablation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def download_raw(root: Path, rows: list[tuple[str, str]], shard_size: int) -> Path:
    """Stage 1 over (url, caption) rows at 64 px, loopback only; returns the output folder."""
    from pairforge.config import parse_config
    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.entry import RunOptions

    lines = ["url,caption"] + [f"{url},\"{caption}\"" for url, caption in rows]
    (root / "in.csv").write_text("\n".join(lines) + "\n")
    cfg = parse_config({"input": {"path": str(root / "in.csv"), "shard_size": shard_size},
                        "output": {"path": str(root / "out")},
                        "download": {"threads": 4, "allow_addresses": ["127.0.0.1/32"],
                                     "image": {"image_size": 64}}})
    run_download(cfg, RunOptions(show_progress=False))
    return root / "out"


@pytest.fixture(scope="session")
def coco_server() -> Iterator[LoopbackServer]:
    """The COCO sample photos on 127.0.0.1, for the whole session."""
    with LoopbackServer(COCO_IMAGES, "127.0.0.1") as server:
        yield server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    """moto's standalone S3 server on 127.0.0.1 (a real S3 endpoint, no AWS anywhere)."""
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def ray_cluster(s3_server: MotoServer) -> Iterator[LocalCluster]:
    """Three Ray nodes started as separate processes on loopback: the head (1 CPU), "gpu"
    (1 CPU and one `gpu_like`, where model pools must go) and "cpu" (1 CPU). Every node
    can reach the S3 server and nothing else (AWS_ENDPOINT_URL, no IMDS)."""
    nodes = {"head": (1, {}), "gpu": (1, {"gpu_like": 1}), "cpu": (1, {})}
    with LocalCluster(nodes, env=s3_server.env) as cluster:
        yield cluster


CLUSTER_IMAGES = 30  # COCO photos in the cluster builds
CLUSTER_SHARD_SIZE = 5


@pytest.fixture(scope="session")
def s3_cluster_build(ray_cluster: LocalCluster, s3_server: MotoServer,
                     coco_server: LoopbackServer, tmp_path_factory: pytest.TempPathFactory
                     ) -> dict[str, Any]:
    """One uninterrupted `pairforge build` on the three-node cluster, input list read from
    and every output written to S3 (s3://BUCKET/in.csv -> s3://BUCKET/out), and Ray's own
    record of where its tasks and actors ran. tests/test_cluster.py and tests/test_s3.py
    both check it; the node-loss test compares its own build against this one."""
    import fsspec

    folder = tmp_path_factory.mktemp("s3_cluster_build")
    bucket = "pairforge-cluster"
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    fs.mkdir(bucket)
    fs.put_file(str(write_coco_input(folder, coco_server.base_url, COCO_CAPTIONS,
                                     CLUSTER_IMAGES, hold_s=0.6)), f"{bucket}/in.csv")
    cfg = build_config(f"s3://{bucket}/in.csv", f"s3://{bucket}/out", ray_cluster.address,
                       CLUSTER_SHARD_SIZE, s3_server.storage_options)
    started = time.monotonic()
    # The driver gets the S3 env too: whatever it opens, nothing may reach AWS.
    done = finish(start_build(ray_cluster, cfg, folder / "run", s3_server.env))
    assert done.returncode == 0, done.stderr[-4000:]
    seconds = time.monotonic() - started
    placement = ray_cluster.placement()
    jobs = {t["job"] for t in placement["tasks"] if t["name"] == "_download_task"}
    assert len(jobs) == 1, jobs
    job = jobs.pop()
    return {"cfg": cfg, "bucket": bucket, "out": f"s3://{bucket}/out", "folder": folder,
            "seconds": seconds, "job": job,
            "tasks": [t for t in placement["tasks"] if t["job"] == job],
            "actors": [a for a in placement["actors"] if a["job"] == job]}


# `make test-fast` (issue 51): the suite without the tests marked slow, cluster or e2e, for
# a first signal in under 3 minutes on 2 cores; `make test` runs every test whatever its
# marks. The marks are given here, by file or node id (a parametrized test's every case),
# so that one list says what the fast loop leaves out and no test file changes for it.
# Chosen from `--durations` timings: a test that builds through the stages on Ray, starts
# a cluster, a Serve app or a trainer, or takes seconds on its own, is out.
FAST_LOOP_LEAVES_OUT: dict[str, tuple[str, ...]] = {
    "cluster": (  # a multi-node Ray cluster (tests/cluster_utils.py)
        "tests/test_cluster.py", "tests/test_dedup_distributed.py",
        "tests/test_semantic_distributed.py"),
    "e2e": (  # stages, builds, Serve or training end to end (local Ray or subprocesses)
        "tests/test_ablation.py", "tests/test_append.py", "tests/test_build.py",
        "tests/test_classifiers.py", "tests/test_dedup.py", "tests/test_download_stage.py",
        "tests/test_golden.py", "tests/test_hostile_input.py", "tests/test_lists.py",
        "tests/test_process_stage.py", "tests/test_ray_private.py", "tests/test_recaption.py",
        "tests/test_recaption_cache_index.py", "tests/test_report.py", "tests/test_reruns.py",
        "tests/test_retry_failed.py", "tests/test_robots.py", "tests/test_semantic_dedup.py",
        "tests/test_serve.py", "tests/test_serve_hostile.py", "tests/test_train_run.py",
        "tests/test_failure_breakdown.py::test_inspect_and_report_show_the_top_hosts_with_statuses",
        "tests/test_force_flags.py::test_process_force_on_a_finished_build_redoes_it",
        "tests/test_preflight.py::test_build_stops_before_downloading_anything",
        "tests/test_recaption_first.py::test_a_recaptioning_build_keeps_every_image_whose_alt_text_is_junk",
        "tests/test_recaption_first.py::test_best_of_two_prompts_and_the_alt_text_through_a_build",
        "tests/test_recaption_first.py::test_without_recaption_junk_alt_text_ends_rows_as_before"),
    "slow": (  # seconds each on their own
        "tests/test_scenes_models.py::test_judge_reads_vq_reconstructions_of_heldout_scenes",
        "tests/test_preflight.py::test_a_repo_the_lookup_finds_is_one_transformers_loads_offline"),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: starts a multi-node Ray cluster (left out "
                            "by make test-fast; .ci/run runs it)")
    config.addinivalue_line("markers", "e2e: runs stages, builds, Serve or training end to "
                            "end (left out by make test-fast; .ci/run runs it)")


def _named(nodeid: str, entry: str) -> bool:
    return nodeid == entry or nodeid.startswith((f"{entry}::", f"{entry}["))


# A test that asks for one of these fixtures is marked too, wherever it is (a new test file
# that starts Ray does not slow the fast loop down unnoticed).
FAST_LOOP_FIXTURES = {"ray_local": "e2e", "ray_cluster": "cluster", "s3_cluster_build": "cluster"}


# `make test` hands whole files to its two xdist workers (--dist loadfile) in collection
# order (--no-loadscope-reorder; xdist's default order, most tests first, left the files
# of few long tests, builds and clusters, for the end, when one worker finished minutes
# before the other). Longest first, the rest after them in their own order: the longest
# processing time rule, so the workers end within about one file of each other. The order
# is by CPU-seconds per file (each xdist worker's process tree in a cgroup of its own,
# 2026-12-07: the suite is CPU-bound, ~2,000 CPU-s on 2 cores), the longest first;
# a file not listed, or listed out of order, only makes the balance a little worse.
LONGEST_FIRST = (
    "tests/test_process_stage.py", "tests/test_recaption.py", "tests/test_cluster.py",
    "tests/test_recaption_first.py", "tests/test_dedup_distributed.py",
    "tests/test_semantic_distributed.py", "tests/test_golden.py", "tests/test_train_run.py",
    "tests/test_serve_hostile.py", "tests/test_download_stage.py", "tests/test_reruns.py",
    "tests/test_serve.py", "tests/test_classifiers.py", "tests/test_semantic_dedup.py",
    "tests/test_decode_in.py", "tests/test_serve_listeners.py", "tests/test_hostile_input.py",
    "tests/test_force_flags.py", "tests/test_onnx_classifier.py", "tests/test_append.py",
    "tests/test_ray_private.py", "tests/test_failure_breakdown.py", "tests/test_preflight.py",
    "tests/test_recaption_cache_index.py", "tests/test_build.py", "tests/test_openai_client.py",
    "tests/test_host_claims.py", "tests/test_dedup.py", "tests/test_host_coordinator.py",
    "tests/test_jpegdecode.py")


def _rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: a file's tests keep their order
    for item in items:
        marks = {mark for mark, entries in FAST_LOOP_LEAVES_OUT.items()
                 if any(_named(item.nodeid, entry) for entry in entries)}
        marks |= {mark for name, mark in FAST_LOOP_FIXTURES.items()
                  if name in getattr(item, "fixturenames", ())}
        for mark in sorted(marks):
            item.add_marker(getattr(pytest.mark, mark))
