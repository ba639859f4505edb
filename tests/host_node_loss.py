"""Stage 1 losing a node mid-run while its hosts take leases from the run's coordinators
(issue 52's fault target, the node case; the coordinator-killed case is
tests/test_host_coordinator.py's). Collected in tests/test_cluster.py, which imports the
test, so that it shares that file's worker and its 3-node cluster (a second cluster in
another xdist worker would cost a minute of start).

On the 3-node loopback cluster (``ray_cluster``), one loopback host's rows spread over
every shard, ``per_host_requests_per_s`` 10. A driver process (this file run as a
script) runs stage 1 once uninterrupted, then again under the cap, recording where the
run's coordinator lives; the test SIGKILLs a worker node while it runs a shard task.

The coordinators live on the head node (``download/host_actors.py``), so the loss takes
none: the run's rate stays the run-wide cap through it, unless a task's lease call went
unanswered (a loaded machine), where the per-task rule applies and the shard's stats say
so. What a node loss can honestly promise about fetching: the task that died with the
node is run again by Ray, and the rows it had fetched are fetched again by its retry (Ray
gives it no record of them). Every other row is fetched once, no row a third time, and
no row is written twice: the retry rewrites its shard whole (a temporary file, renamed),
and the stage removes the dead attempt's temporary file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loopback_server import LoopbackServer, make_images

CAP = 10  # requests a second for the host, the whole run
ROWS, SHARD_SIZE = 90, 10
KILL_AFTER = 12  # image requests of the capped run before the kill: mid-run


class _Counting(LoopbackServer):
    """``/n/<i>``: an image; ``arrivals``: (time, path) of every request."""

    def __init__(self, image_dir: Path) -> None:
        super().__init__(image_dir)
        self.arrivals: list[tuple[float, str]] = []

    def _record(self, path: str, headers: dict[str, str]) -> None:
        self.arrivals.append((time.monotonic(), path))  # list.append: atomic
        super()._record(path, headers)

    def _route_n(self, handler: Any, rest: str, query: dict[str, str]) -> None:
        self._send_image(handler, "red.jpg")


def _per_second(times: list[float], first: float) -> list[int]:
    counts = Counter(int(t - first) for t in times)
    return [counts[i] for i in range(max(counts) + 1)]


def _rows(out: Path) -> list[tuple[str, str, str]]:
    import pyarrow.parquet as pq

    return sorted((r["key"], r["status"], r["caption"])
                  for f in sorted((out / "raw").glob("*.parquet"))
                  for r in pq.read_table(f, columns=["key", "status", "caption"]).to_pylist())


def _wait_for(condition: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def losing_a_node_mid_run(ray_cluster: Any, tmp_path: Path) -> None:
    """The test (tests/test_cluster.py runs it, last of that file's)."""
    alive = ray_cluster.alive_nodes()
    for name in ("gpu", "cpu"):  # test_cluster.py leaves "cpu" dead for later users
        if name not in alive:
            ray_cluster.restart(name)
    images = tmp_path / "images"
    images.mkdir()
    make_images(images)
    with _Counting(images) as reference_site, _Counting(images) as site:
        spec = {"address": ray_cluster.address, "folder": str(tmp_path), "cap": CAP,
                "reference": [reference_site.url(f"/n/{i}") for i in range(ROWS)],
                "urls": [site.url(f"/n/{i}") for i in range(ROWS)]}
        env = {**os.environ, **ray_cluster.driver_env}
        env.pop("RAY_ADDRESS", None)
        driver = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        output: dict[str, str] = {}
        reader = threading.Thread(target=lambda: output.update(
            zip(("out", "err"), driver.communicate(timeout=400), strict=True)))
        reader.start()
        killed = None
        try:
            placed = tmp_path / "coordinator.json"
            victim: list[str] = []

            def ready() -> bool:  # mid-run, the coordinator up, a worker node in a task
                if not reader.is_alive():
                    return True
                if len(site.arrivals) < KILL_AFTER or not placed.exists():
                    return False
                victim[:] = [n for n in ("cpu", "gpu")
                             if ray_cluster.running(n, "ray::_download_task")][:1]
                return bool(victim)

            _wait_for(ready, 300, "no shard task ran on a worker node mid-run")
            assert reader.is_alive(), output.get("err", "")[-4000:]
            killed_at = time.monotonic()
            ray_cluster.started[victim[0]].kill()
            killed = victim[0]
            reader.join(400)
        finally:
            if driver.poll() is None:
                driver.kill()
            reader.join(10)
            if killed is not None:  # later users of the fixture get their three nodes
                ray_cluster.wait_dead(killed)
                ray_cluster.restart(killed)
        arrivals = [(t, p) for t, p in site.arrivals if p.startswith("/n/")]
    assert driver.returncode == 0, output.get("err", "")[-4000:]
    # the driver's result line; Ray may print its own lines (a raylet's) after it
    result = json.loads(next(line for line in reversed(output["out"].splitlines())
                             if line.startswith('{"summary"')))

    # every row ends with a status, as an uninterrupted run ends it; nothing half written
    assert result["summary"]["status"] == {"ok": ROWS}
    assert len(_rows(tmp_path / "run")) == ROWS
    assert _rows(tmp_path / "run") == _rows(tmp_path / "reference")
    assert [p.name for p in (tmp_path / "run").rglob("*") if ".tmp-" in p.name] == []

    # fetched twice: only rows of the one shard whose task died with the node, the second
    # time by its retry, after the kill; every row at least once, none three times
    seen = Counter(p for _, p in arrivals)
    assert set(seen) == {f"/n/{i}" for i in range(ROWS)} and max(seen.values()) <= 2
    twice = [p for p, n in seen.items() if n == 2]
    assert len({int(p.rsplit("/", 1)[1]) // SHARD_SIZE for p in twice}) <= 1, twice
    for path in twice:
        assert max(t for t, p in arrivals if p == path) > killed_at

    # the coordinator lived on the head through the run, the loss included: never lost,
    # never restarted (the stage removes it after the last task: dead, if seen in time)
    head = ray_cluster.started["head"].node_id
    places = result["coordinator"]
    lived = [(p["node"], p["state"]) for p in places
             if p["state"] in ("ALIVE", "RESTARTING", "DEAD")]  # not the steps of its making
    assert lived in ([(head, "ALIVE")], [(head, "ALIVE"), (head, "DEAD")]), places

    # the rate: the run-wide cap (+1 for a window's edge), the loss included; only a task
    # whose lease call went unanswered follows the per-task rule (the cap for itself
    # alone: three tasks at once at most), and the shard's stats then count it
    times = [t for t, _ in arrivals]
    windows = _per_second(times, min(times))
    fallbacks = sum(counts.get("coordinator_fallback", 0) for s in result["stats"]
                    for counts in s["politeness"].values())  # the one host's
    print(f"per second {windows}; {killed} killed at window "
          f"{int(killed_at - min(times))}; fetched twice {len(twice)}; "
          f"fallbacks {fallbacks}")
    assert max(windows) <= (CAP + 1 if not fallbacks else 3 * CAP + 3)


# --------------------------------------------------- the driver (this file as a script)


def _stage1(folder: Path, name: str, urls: list[str], cap: float | None) -> dict[str, Any]:
    from pairforge.config import parse_config
    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.entry import RunOptions

    (folder / f"{name}.csv").write_text("url,caption\n" + "".join(
        f"{u},photo {i}\n" for i, u in enumerate(urls)))
    cfg = parse_config({
        "input": {"path": str(folder / f"{name}.csv"), "shard_size": SHARD_SIZE},
        "output": {"path": str(folder / name)},
        "download": {"threads": 4, "timeout": 5.0, "retries": 0, "robots_txt": False,
                     "tdm": False, "allow_addresses": ["127.0.0.1/32"],
                     "per_host_requests_per_s": cap, "image": {"image_size": 32}}})
    return run_download(cfg, RunOptions(show_progress=False))


def drive(spec: dict[str, Any]) -> None:
    """The driver: the reference run, then the capped run with the coordinator's first
    place in ``coordinator.json``; prints the summary, the shards' stats and the
    coordinator's places (each change of node or state)."""
    import ray
    from cluster_utils import ActorPlaces

    folder = Path(spec["folder"])
    ray.init(address=spec["address"], logging_level="ERROR", log_to_driver=False)
    _stage1(folder, "reference", spec["reference"], None)
    places = ActorPlaces("pairforge-hosts-")

    def tell() -> None:
        while (first := places.first_alive()) is None:
            time.sleep(0.05)
        (folder / "coordinator.json").write_text(json.dumps(first))

    threading.Thread(target=tell, daemon=True).start()
    summary = _stage1(folder, "run", spec["urls"], spec["cap"])
    stats = [json.loads(f.read_text())
             for f in sorted((folder / "run" / "raw").glob("*_stats.json"))]
    print(json.dumps({"summary": {"status": summary["status"]}, "stats": stats,
                      "coordinator": places.stop()}))


if __name__ == "__main__":
    drive(json.loads(sys.argv[1]))
