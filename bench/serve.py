"""``pairforge serve`` under load, over real HTTP, against a bare batched loop (issue 37).

    python bench/serve.py [--config examples/demo.yaml] [--set KEY=VALUE ...]
                          [--url http://127.0.0.1:PORT] [--phase-s 12] [--soak 10000]
                          [--json results.json]

Without ``--url`` it starts the service itself on local Ray (``start_service``, the code
``pairforge serve`` runs) with the config (the demo's captioner by default) and
``serve.cache.max_entries`` 2000: the uploads are the bundled sample's 10,000 distinct
scenes sent in turn, so with an LRU of 2000 every request is a miss and runs the model
(and the cache stays full and evicting through the soak). Phases, in order:

1. the bare loop: the same ``CheckedCaptioner`` in this process, on the same decoded
   uploads, in batches of ``serve.max_batch_size``, with the replica's torch threads
   (again after the soak: the ratio uses the better of the two);
2. closed loop: 1, 2, 4, ..., 64 clients each sending its next request when the last is
   answered (the single-request latency is concurrency 1's p50; the saturation rate is
   the best images/s of the sweep);
3. open loop: Poisson arrivals at 25, 50, 75 and 100 % of that rate (latency counts from
   the scheduled send, so a queue that builds up shows);
4. the soak: ``--soak`` requests from 16 clients, the replica processes' RSS (VmRSS of
   every ``ServeReplica`` process on this machine) sampled every second.

Batch sizes are the service's own (``pairforge_serve_batch_size`` from ``/metrics``, the
difference over each phase).

``--pairs N`` runs only the bare loop and 64 closed-loop clients in turn, N times, and
gives each side's CPU as well: the bare loop's CPU milliseconds per image (this process),
and the service's per answered request by role (``process_cpu``: the model replica, the
ingress replica, HAProxy, the rest of Ray, and this process, the driver and the load
generator), and ``model_cores``, the share of a core the model replica had while
saturated. On a shared host the images/s ratio moves with the other work; the CPU
figures move less, and ``cpu_ratio_median`` says what they allow on an idle host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import aiohttp
from common import REPO, SAMPLE, arg_parser

from pairforge.config import load_config
from pairforge.serve.inputs import decode_upload

SCENES = sorted((SAMPLE / "images").glob("*.png"))


def percentiles(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"p50_ms": at(0.50), "p95_ms": at(0.95), "p99_ms": at(0.99)}


class Load:
    """Sends the scenes in turn to ``url``; counts answers, errors and latencies."""

    def __init__(self, url: str, bodies: list[bytes]) -> None:
        self.url, self.bodies, self.next = url + "/v1/captions", bodies, 0

    def body(self) -> bytes:
        self.next += 1
        return self.bodies[(self.next - 1) % len(self.bodies)]

    async def one(self, session: aiohttp.ClientSession, result: dict, started: float) -> None:
        try:
            async with session.post(self.url, data=self.body(),
                                    headers={"Content-Type": "image/png"}) as response:
                await response.read()
                ok = response.status == 200
        except aiohttp.ClientError:
            ok = False
        result["latencies" if ok else "errors"].append(time.perf_counter() - started)

    async def closed(self, clients: int, seconds: float, count: int | None = None) -> dict:
        result: dict = {"latencies": [], "errors": []}
        stop = time.perf_counter() + seconds
        sent = 0

        async def client(session: aiohttp.ClientSession) -> None:
            nonlocal sent
            while (time.perf_counter() < stop) if count is None else sent < count:
                sent += 1
                await self.one(session, result, time.perf_counter())

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            start = time.perf_counter()
            await asyncio.gather(*(client(session) for _ in range(clients)))
            result["seconds"] = time.perf_counter() - start
        return result

    async def open(self, rate: float, seconds: float, seed: int = 0) -> dict:
        result: dict = {"latencies": [], "errors": []}
        rng = random.Random(seed)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            start = time.perf_counter()
            due, tasks = start, []
            while due < start + seconds:
                due += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                tasks.append(asyncio.create_task(self.one(session, result, due)))
            await asyncio.gather(*tasks)
            result["seconds"] = time.perf_counter() - start
        return result


def summary(result: dict, batches: tuple[float, float]) -> dict:
    done = len(result["latencies"])
    out = {"requests": done + len(result["errors"]), "errors": len(result["errors"]),
           "images_per_s": round(done / result["seconds"], 1)}
    out.update(percentiles(result["latencies"]) if done else {})
    count, total = batches
    out["mean_batch"] = round(total / count, 2) if count else None
    return out


def batch_counters(url: str) -> tuple[float, float]:
    import requests

    text = requests.get(url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        for name in ("pairforge_serve_batch_size_count", "pairforge_serve_batch_size_sum"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return (values.get("pairforge_serve_batch_size_count", 0.0),
            values.get("pairforge_serve_batch_size_sum", 0.0))


def measured(url: str, run) -> dict:  # noqa: ANN001
    before = batch_counters(url)
    result = asyncio.run(run)
    after = batch_counters(url)
    return summary(result, (after[0] - before[0], after[1] - before[1]))


def replica_rss_mb() -> float:
    """The VmRSS of every Ray Serve replica process on this machine, in MB."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"ServeReplica" not in (proc / "cmdline").read_bytes():
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return round(total / 1024, 1)


def bare_loop(cfg, bodies: list[bytes], seconds: float) -> dict:  # noqa: ANN001
    """The same checked captioner, batched, in this process: the ceiling serve is held to."""
    import torch

    from pairforge.recaption.checked import CheckedCaptioner

    torch.set_num_threads(cfg.process.recaption.torch_threads or 1)
    checked = CheckedCaptioner(cfg.process.recaption, cfg.process.clip, "cpu")
    images = [decode_upload(b, cfg.serve, cfg.download.image).image for b in bodies[:512]]
    batch = cfg.serve.max_batch_size
    checked.caption_images(images[:batch])  # warm up
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        at = done % len(images)
        done += len(checked.caption_images(images[at:at + batch]))
    return {"images_per_s": round(done / (time.perf_counter() - start), 1),
            "cpu_ms_per_image": round(1000 * (time.process_time() - cpu) / done, 2),
            "batch": batch, "torch_threads": torch.get_num_threads()}


def process_cpu() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of this process and its descendants (the local
    Ray this process started: its GCS, raylet, agents, workers, Serve's actors, HAProxy).
    Roles: "model" and "ingress" (the two deployments' replicas), "haproxy" and "ray"
    (everything else); ``cpu_per_request`` counts this process (the driver and the load
    generator) as "driver"."""
    tick, parents, seen = os.sysconf("SC_CLK_TCK"), {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name, rest = (entry / "stat").read_text().split("(", 1)[1].rsplit(")", 1)
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            fields = rest.split()
            parents[int(entry.name)] = int(fields[1])
            seen[int(entry.name)] = (_role(name, command),
                                     (int(fields[11]) + int(fields[12])) / tick)
    tree = [os.getpid()]
    for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
    return {pid: seen[pid] for pid in tree if pid in seen}


def _role(name: str, command: bytes) -> str:
    from pairforge.serve.app import INGRESS_DEPLOYMENT
    from pairforge.serve.model import MODEL_DEPLOYMENT

    if f":{MODEL_DEPLOYMENT}".encode() in command:
        return "model"
    if f":{INGRESS_DEPLOYMENT}".encode() in command:
        return "ingress"
    return "haproxy" if name == "haproxy" else "ray"


def cpu_per_request(before: dict, after: dict, requests: int) -> dict[str, float]:
    """CPU milliseconds per answered request by role, between two ``process_cpu``."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        role = "driver" if pid == os.getpid() else role
        spent[role] = spent.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    out = {f"{role}_cpu_ms": round(1000 * value / max(1, requests), 2)
           for role, value in sorted(spent.items())}
    out["all_cpu_ms"] = round(1000 * sum(spent.values()) / max(1, requests), 2)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = arg_parser(__doc__)
    parser.add_argument("--config", default=str(REPO / "examples" / "demo.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--url", help="a running service (default: start one here)")
    parser.add_argument("--phase-s", type=float, default=12.0)
    parser.add_argument("--soak", type=int, default=10_000)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--pairs", type=int, default=0,
                        help="only interleaved pairs: the bare loop, then 64 closed-loop "
                        "clients, this many times (the saturation ratio on a noisy host)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --latency: this many rounds, each ratio from its own "
                        "round (the median is the figure on a noisy host)")
    parser.add_argument("--latency", type=float, metavar="RATE",
                        help="only the latency target: 1 closed-loop client, then Poisson "
                        "arrivals at half of RATE (a saturation rate measured before)")
    return parser


def main() -> None:
    args = _parser().parse_args()
    overrides = ["serve.cache.max_entries=2000", "process.recaption.torch_threads=1",
                 "ray.num_cpus=2", *args.overrides]
    cfg = load_config(Path(args.config), overrides)
    bodies = [p.read_bytes() for p in SCENES]
    report: dict = {"config": args.config, "overrides": overrides}
    if args.latency:
        url = args.url or start(cfg)
        load = Load(url, bodies)
        measured(url, load.closed(1, 3.0))  # warm up
        rounds = []
        for _ in range(args.rounds):
            single = measured(url, load.closed(1, args.phase_s))
            half = measured(url, load.open(args.latency / 2, args.phase_s))
            rounds.append({"single": single, "half": half,
                           "p99_at_half_vs_single": round(half["p99_ms"] / single["p50_ms"], 2)})
            print(json.dumps(rounds[-1]), flush=True)
        ratios = [r["p99_at_half_vs_single"] for r in rounds]
        report["latency"] = {"rounds": rounds, "median_ratio": statistics.median(ratios)}
        print(json.dumps({"ratios": ratios, "median": statistics.median(ratios)}), flush=True)
        return
    if args.pairs:
        report["pairs"] = pairs(cfg, bodies, args)
        print(json.dumps(report["pairs"]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return
    report["bare_loop"] = bare_loop(cfg, bodies, args.phase_s)
    print("bare loop", report["bare_loop"], flush=True)
    url = args.url or start(cfg)
    load = Load(url, bodies)
    measured(url, load.closed(4, 3.0))  # warm up
    report["closed_loop"] = {}
    for clients in (1, 2, 4, 8, 16, 32, 64):
        report["closed_loop"][clients] = measured(url, load.closed(clients, args.phase_s))
        print("closed", clients, report["closed_loop"][clients], flush=True)
    saturation = max(r["images_per_s"] for r in report["closed_loop"].values())
    single = report["closed_loop"][1]["p50_ms"]
    report["open_loop"] = {}
    for share in (0.25, 0.5, 0.75, 1.0):
        report["open_loop"][share] = measured(url, load.open(share * saturation, args.phase_s))
        print("open", share, report["open_loop"][share], flush=True)
    report["soak"] = soak(url, load, args.soak)
    print("soak", report["soak"], flush=True)
    report["bare_loop_after"] = bare_loop(cfg, bodies, args.phase_s)  # the host drifts
    print("bare loop after", report["bare_loop_after"], flush=True)
    bare = max(report["bare_loop"]["images_per_s"], report["bare_loop_after"]["images_per_s"])
    report["targets"] = {
        "saturation_vs_bare": round(saturation / bare, 2),
        "p99_at_half_vs_single": round(report["open_loop"][0.5]["p99_ms"] / single, 2),
        "soak_errors": report["soak"]["errors"],
        "soak_rss_growth": report["soak"]["rss_growth"]}
    print(json.dumps(report["targets"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def pairs(cfg, bodies: list[bytes], args: argparse.Namespace) -> dict:  # noqa: ANN001
    """Bare loop and saturated service in turn: each ratio compares neighbours in time."""
    url = args.url or start(cfg)
    load = Load(url, bodies)
    measured(url, load.closed(4, 3.0))  # warm up
    rows = []
    for _ in range(args.pairs):
        bare = bare_loop(cfg, bodies, args.phase_s)
        before = process_cpu()
        served = measured(url, load.closed(64, args.phase_s))
        cpu = cpu_per_request(before, process_cpu(), served["requests"] - served["errors"])
        rows.append({"bare": bare["images_per_s"], "serve": served["images_per_s"],
                     "mean_batch": served["mean_batch"], "errors": served["errors"],
                     "ratio": round(served["images_per_s"] / bare["images_per_s"], 2),
                     "bare_cpu_ms": bare["cpu_ms_per_image"], **cpu,
                     # the cores the model replica had: 1.0 is a core of its own
                     "model_cores": round(cpu.get("model_cpu_ms", 0.0)
                                          * served["images_per_s"] / 1000, 2),
                     "load": round(os.getloadavg()[0], 1)})
        print(rows[-1], flush=True)
    ratios = sorted(r["ratio"] for r in rows)
    # what the CPU figures allow on a host with nothing else to run: the service is held
    # by its model replica (one model thread) or by all of its processes sharing the cores
    cores = os.cpu_count() or 1
    cpu_ratios = sorted(r["bare_cpu_ms"] / max(r.get("model_cpu_ms", 0.0),
                                               r["all_cpu_ms"] / cores) for r in rows)
    return {"rows": rows, "ratio_median": statistics.median(ratios),
            "ratio_range": [ratios[0], ratios[-1]],
            "cpu_ratio_median": round(statistics.median(cpu_ratios), 2)}


def start(cfg) -> str:  # noqa: ANN001
    import requests

    from pairforge.serve.run import start_service

    url = start_service(cfg, "127.0.0.1", 18000 + random.randrange(1000))
    while True:
        try:
            answer = requests.get(url + "/readyz", timeout=5)
            if answer.status_code == 200:
                return url
            if "still loading" not in answer.text:  # the models failed to load: say why
                raise SystemExit(f"the service did not start: {answer.text}")
        except requests.ConnectionError:
            pass
        time.sleep(0.5)


def soak(url: str, load: Load, count: int) -> dict:
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        start = time.perf_counter()
        while not done.wait(1.0):
            samples.append((round(time.perf_counter() - start, 1), replica_rss_mb()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = measured(url, load.closed(16, float("inf"), count))
    done.set()
    sampler.join()
    rss = [mb for _, mb in samples]
    # growth: the last tenth's median against the first tenth's after warm-up
    tenth = max(1, len(rss) // 10)
    first, last = statistics.median(rss[:tenth]), statistics.median(rss[-tenth:])
    result.update(rss_mb_first=first, rss_mb_last=last, rss_mb_max=max(rss),
                  rss_growth=round(last / first - 1, 4), rss_samples=len(rss))
    return result


if __name__ == "__main__":
    main()
