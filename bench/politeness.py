"""Stage 1's politeness for the whole run (issue 52): what one loopback host sees when its
rows are spread over every shard of a run.

    python bench/politeness.py                    # caps 5, 20 and none; 8 shards, 2 at once
    python bench/politeness.py --before           # also each cap with the per-task rule
    python bench/politeness.py --caps 20 --rows 400
    python bench/politeness.py --caps 20 --before --cluster   # 3-node loopback cluster
    python bench/politeness.py --caps 20 --cluster --kill-node  # a node lost mid-run

Each run is a child process: a loopback HTTP server on 127.0.0.1 (threads; every
``/img/<n>.jpg`` is one small JPEG, ``/robots.txt`` and ``/.well-known/tdmrep.json`` allow
everything) and ``run_download`` on a local Ray (2 CPUs: 2 shard tasks at once) over
``--rows`` rows of that one host in ``--shards`` shards, robots.txt and TDM at their
defaults (on); ``--cluster`` runs it on a 3-node loopback cluster instead (tests/
cluster_utils.py: three ``ray start`` nodes of 1 CPU each on 127.0.0.2, each with its own
TMPDIR as separate machines would have, 3 tasks at once, one a node). The server logs
each request's arrival; the figures are the image requests per 1-second window from the
first (the busiest window, the busiest after the first, and the busiest sliding 1-s
window), the overall rate (requests over the span of arrivals), the rows ended ok, and
how many times each policy file was requested. ``--before`` runs each
cap again with ``PAIRFORGE_HOST_COORDINATORS=off`` in the workers' environment (the job's
runtime env): every task applies the cap to itself alone, and each node fetches the
policy files for itself, as stage 1 did before issue 52.

``--kill-node`` (with ``--cluster``; run-wide runs only): once the server has seen
``--kill-after`` image requests, a worker node running a shard task is SIGKILLed. Ray
runs the lost task again; the run's coordinator lives on the head node and is not lost.
The figures are then the requests per 1-s window around the kill, whether the
coordinator stayed where it was (alive, never restarted), the image requests over the
rows (the lost task's rows fetched again by its retry), and the shards'
``coordinator_fallback`` counts (a task whose lease call went unanswered followed the
per-task rule). The node is started again after each such run.

Target (issue 52): with a cap of 20, at most 22 requests in every 1-s window after the
first, and the run completes; with a node lost, every row ends with a status and the rate
stays the cap (the per-task rule, the cap per task, only where the fallback applied).
Loopback only: the script never sends a request elsewhere.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from common import TESTS, arg_parser

POLICY_FILES = {"/robots.txt": (b"User-agent: *\nAllow: /\n", "text/plain"),
                "/.well-known/tdmrep.json": (b"[]\n", "application/json")}


def _jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(out, "JPEG", quality=90)
    return out.getvalue()


class _Site(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.image = _jpeg()
        self.arrivals: list[tuple[float, str]] = []
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Site

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?")[0]
        with self.server.lock:
            self.server.arrivals.append((time.monotonic(), path))
        body, kind = POLICY_FILES.get(path, (self.server.image, "image/jpeg"))
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def windows(times: list[float]) -> dict[str, Any]:
    """Requests per 1-s window from the first, and the busiest sliding 1-s window."""
    if not times:
        return {}
    times = sorted(times)
    first = times[0]
    counts = Counter(int(t - first) for t in times)
    per_second = [counts[i] for i in range(max(counts) + 1)]
    sliding, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - 1.0:
            j += 1
        sliding = max(sliding, i - j + 1)
    span = times[-1] - first
    return {"per_second": per_second, "busiest": max(per_second),
            "busiest_after_first": max(per_second[1:], default=0),
            "busiest_sliding": sliding,
            "overall_per_s": round((len(times) - 1) / span, 1) if span > 0 else None}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One run: the site, stage 1 over it, the server's figures."""
    from pairforge.config import parse_config
    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.entry import RunOptions

    site = _Site()
    threading.Thread(target=site.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{site.server_address[1]}"
    folder = Path(tempfile.mkdtemp(prefix="pf-politeness-"))
    (folder / "in.csv").write_text("url,caption\n" + "".join(
        f"{base}/img/{i}.jpg,a red square {i}\n" for i in range(spec["rows"])))
    download: dict[str, Any] = {"allow_addresses": ["127.0.0.1/32"], "retries": 0,
                                "image": {"image_size": 32}}
    ray: dict[str, Any] = ({"address": spec["address"]} if spec.get("address")
                           else {"num_cpus": 2})
    if spec["before"]:
        ray["runtime_env"] = {"env_vars": {"PAIRFORGE_HOST_COORDINATORS": "off"}}
    if spec["cap"] is not None:
        download["per_host_requests_per_s"] = spec["cap"]
    cfg = parse_config({"input": {"path": str(folder / "in.csv"),
                                  "shard_size": -(-spec["rows"] // spec["shards"])},
                        "output": {"path": str(folder / "out")}, "download": download,
                        "ray": ray})
    loss = NodeLoss(spec, site, cfg.ray) if spec.get("signal") else None
    started = time.time()
    summary = run_download(cfg, RunOptions(show_progress=False))
    seconds = time.time() - started
    site.shutdown()
    images = [t for t, p in site.arrivals if p.startswith("/img/")]
    files = Counter(p for _, p in site.arrivals if p in POLICY_FILES)
    return {**spec, "ok": summary["status"].get("ok", 0), "status": summary["status"],
            "image_requests": len(images), "seconds": round(seconds, 1),
            "policy_file_requests": dict(files), **windows(images),
            **(loss.figures(images, folder / "out") if loss else {})}


class NodeLoss:
    """The child's side of ``--kill-node``: ``ready`` in the signal folder once the site
    has seen ``kill_after`` image requests (the parent then kills a node and writes
    ``killed``, its ``time.monotonic()``), and where the run's coordinator lived."""

    def __init__(self, spec: dict[str, Any], site: _Site, ray_cfg: Any) -> None:
        import ray

        sys.path.insert(0, str(TESTS))
        from cluster_utils import ActorPlaces

        self.signal = Path(spec["signal"])
        ray.init(address=spec["address"], logging_level="ERROR", log_to_driver=False,
                 runtime_env=ray_cfg.runtime_env)
        self.places = ActorPlaces("pairforge-hosts-")
        self.site, self.kill_after = site, spec["kill_after"]
        threading.Thread(target=self._tell, daemon=True).start()

    def _tell(self) -> None:
        while sum(p.startswith("/img/") for _, p in list(self.site.arrivals)) < self.kill_after:
            time.sleep(0.05)
        (self.signal / "ready").touch()

    def figures(self, images: list[float], out: Path) -> dict[str, Any]:
        places = self.places.stop()
        killed = self.signal / "killed"
        killed_at = float(killed.read_text()) if killed.exists() else None
        fallbacks = sum(counts.get("coordinator_fallback", 0)
                        for f in out.glob("raw/*_stats.json")
                        for counts in json.loads(f.read_text())["politeness"].values())
        return {"kill_window": int(killed_at - min(images)) if killed_at else None,
                "coordinator_places": [(p["node"], p["state"]) for p in places],
                "coordinator_fallback": fallbacks}


def run_child(spec: dict[str, Any], env_extra: dict[str, str],
              cluster: Any = None) -> dict[str, Any]:
    """One run in a child process; with ``cluster`` and ``spec["signal"]``, the node that
    holds the coordinator is killed mid-run (``NodeLoss``) and started again after."""
    # bench/ first, then the caller's path (a worktree's checkout stays the one imported)
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                         os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, **env_extra}
    env.pop("RAY_ADDRESS", None)
    with subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        killed = _kill_mid_run(cluster, spec, proc) if spec.get("signal") else None
        out, err = proc.communicate()
    names = {n.node_id: name for name, n in cluster.started.items()} if cluster else {}
    if killed:
        cluster.wait_dead(killed)
        cluster.restart(killed)  # the next run gets its three nodes
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"child failed ({proc.returncode}):\n{err[-3000:]}")
    result = json.loads(lines[-1])
    if "coordinator_places" in result:  # node names, where the nodes were this run's
        result["coordinator_places"] = [(names.get(node, node), state)
                                        for node, state in result["coordinator_places"]]
    return {**result, "killed": killed}


def _kill_mid_run(cluster: Any, spec: dict[str, Any], proc: subprocess.Popen) -> str | None:
    """Once the child says ``ready``: SIGKILL the first worker node running a shard task."""
    ready = Path(spec["signal"]) / "ready"
    while True:
        if proc.poll() is not None:
            return None  # the run ended first (too few rows for --kill-after)
        busy = [n for n in list(cluster.started)[1:]
                if cluster.running(n, "ray::_download_task")] if ready.exists() else []
        if busy:
            break
        time.sleep(0.05)
    cluster.started[busy[0]].kill()
    (Path(spec["signal"]) / "killed").write_text(repr(time.monotonic()))
    return busy[0]


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--caps", default="5,20,none",
                        help="comma-separated caps (requests/s), 'none' for no cap")
    parser.add_argument("--before", action="store_true",
                        help="also run each cap with the per-task rule (before issue 52)")
    parser.add_argument("--cluster", action="store_true",
                        help="on a 3-node loopback cluster (tests/cluster_utils.py)")
    parser.add_argument("--kill-node", action="store_true",
                        help="with --cluster: kill a worker node mid-run")
    parser.add_argument("--kill-after", type=int, default=60,
                        help="image requests the server sees before the kill")
    parser.add_argument("--child", help=argparse_hidden())
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if not args.cluster:
        if args.kill_node:
            raise SystemExit("--kill-node needs --cluster")
        runs(args, None, {})
        return
    sys.path.insert(0, str(TESTS))
    from cluster_utils import LocalCluster

    class Nodes(LocalCluster):
        """Each node its own TMPDIR, as separate machines have: the node-local cache of
        policy files (download/consent.py) is then per node, not one for the machine."""

        def _spawn(self, name: str, head: bool) -> None:
            tmp = self.temp_dir / f"tmp-{name}"
            tmp.mkdir(exist_ok=True)
            self.env["TMPDIR"] = str(tmp)
            super()._spawn(name, head)

    with Nodes({"head": (1, {}), "node2": (1, {}), "node3": (1, {})}) as cluster:
        print(f"3-node loopback cluster at {cluster.address}", flush=True)
        runs(args, cluster.address, cluster.driver_env, cluster)


def runs(args: Any, address: str | None, env: dict[str, str], cluster: Any = None) -> None:
    """Every cap of ``args``, with the per-task rule first where ``--before`` asks."""
    caps = [None if c == "none" else float(c) for c in args.caps.split(",")]
    for cap in caps:
        # a cap of 5 over 400 rows would take 80 s: its figures are the same at 200
        rows = min(args.rows, 200) if cap is not None and cap < 10 else args.rows
        for before in ([True, False] if args.before else [False]):
            spec = {"cap": cap, "rows": rows, "shards": args.shards, "before": before,
                    "address": address}
            if args.kill_node and not before:
                spec.update(signal=tempfile.mkdtemp(prefix="pf-kill-"),
                            kill_after=args.kill_after)
            result = run_child(spec, env, cluster)
            rule = "per-task rule" if before else "run-wide"
            where = "3 nodes" if address else "local Ray"
            print(f"{where}, cap {cap or 'none'} ({rule}): {result['ok']}/{rows} ok in "
                  f"{result['seconds']} s; {result['overall_per_s']} req/s overall, busiest "
                  f"1-s window {result['busiest']} (after the first "
                  f"{result['busiest_after_first']}, sliding {result['busiest_sliding']}); "
                  f"policy files requested {result['policy_file_requests']}; per second "
                  f"{result['per_second']}", flush=True)
            if "kill_window" in result:
                print(f"  node {result['killed']} killed in window {result['kill_window']}; "
                      f"coordinator (node, state) {result['coordinator_places']}; "
                      f"{result['image_requests']} image requests for {rows} rows; "
                      f"coordinator_fallback {result['coordinator_fallback']}; "
                      f"status {result['status']}", flush=True)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
