"""The OpenAI-compatible captioning client: requests in flight, measured at the server.

    python bench/openai_client.py [--mode bare|step|both] [--requests 2000]
                                  [--concurrency 32] [--batch-size 8] [--pool-size 1]

A local OpenAI-compatible server (aiohttp, in a child process, 127.0.0.1 only) answers
every chat completion in 200 ms, and every 10th request (by arrival) in 2 s: a real
server's tail. Mean latency 0.38 s, so C requests in flight allow C / 0.38 requests/s
(84.2/s at 32). The server samples how many requests it holds every 10 ms.

- bare: asyncio + aiohttp, a semaphore of C, every request at once: the ceiling of a
  client at this concurrency;
- step: the recaption step as stage 3 places it on Ray Data (``placement.add_steps``: the
  block cut, the actor pool, the actor's concurrent batches), one pool of ``--pool-size``
  actors, over ``--requests`` rows of small distinct images (cache and grounding off,
  dedup on so no claim registry: only the client and the pool's batching are measured).

Figures per run: whole-run requests/s (first arrival to last answer), steady requests/s
and in-flight (from the first arrival to the last arrival: after it the run drains), the
share of 10 ms samples in that window at exactly C, and the smallest count after the first
second. Today's code against the code before (issue 49): check the older commit out into
a worktree and run this file with ``PYTHONPATH`` pointing at it (the script prints which
``pairforge`` the actors imported).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing as mp
import socket
import time
from typing import Any

FAST_S, SLOW_S, SLOW_EVERY = 0.2, 2.0, 10
MEAN_LATENCY_S = FAST_S * (SLOW_EVERY - 1) / SLOW_EVERY + SLOW_S / SLOW_EVERY


def _serve(port: int, ready: Any) -> None:
    """The server process: answers, counts, samples in flight every 10 ms."""
    from aiohttp import web

    state: dict[str, Any] = {"arrived": 0, "in_flight": 0, "samples": [], "arrivals": [],
                             "done": []}

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        state["arrived"] += 1
        state["arrivals"].append(time.monotonic())
        state["in_flight"] += 1
        try:
            await asyncio.sleep(SLOW_S if state["arrived"] % SLOW_EVERY == 0 else FAST_S)
        finally:
            state["in_flight"] -= 1
        state["done"].append(time.monotonic())
        return web.json_response({"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "A photo of a cat."}}]})

    async def stats(request: web.Request) -> web.Response:
        reply = {k: state[k] for k in ("samples", "arrivals", "done")}
        for k in ("samples", "arrivals", "done"):
            state[k] = []
        state["arrived"] = 0
        return web.json_response(reply)

    async def sample() -> None:
        while True:
            if state["arrivals"]:
                state["samples"].append((time.monotonic(), state["in_flight"]))
            await asyncio.sleep(0.01)

    async def main() -> None:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/chat/completions", complete)
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        asyncio.get_running_loop().create_task(sample())
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_stats(base: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(base + "/stats") as response:  # 127.0.0.1 only
        return json.loads(response.read())


def summary(stats: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """Throughput and in-flight figures of one run, from the server's records."""
    arrivals, done, samples = stats["arrivals"], stats["done"], stats["samples"]
    first, last_arrival, last_done = min(arrivals), max(arrivals), max(done)
    window = [n for t, n in samples if first <= t <= last_arrival]
    settled = [n for t, n in samples if first + 1.0 <= t <= last_arrival]
    in_window = sum(first <= t <= last_arrival for t in done)
    steady = in_window / max(last_arrival - first, 1e-9)
    return {"requests": len(done), "seconds": round(last_done - first, 2),
            "requests_per_s": round(len(done) / (last_done - first), 1),
            "steady_requests_per_s": round(steady, 1),
            "of_concurrency_over_latency": round(steady / (concurrency / MEAN_LATENCY_S), 3),
            "mean_in_flight": round(sum(window) / max(len(window), 1), 1),
            "share_at_concurrency": round(sum(n == concurrency for n in window)
                                          / max(len(window), 1), 3),
            "min_in_flight_after_1s": min(settled, default=None),
            "max_in_flight": max((n for _, n in samples), default=0)}


def _body(image_url: str) -> dict[str, Any]:
    return {"model": "served", "max_tokens": 48, "temperature": 0.0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": "Describe the image."}]}]}


def run_bare(base: str, n: int, concurrency: int) -> None:
    """The ceiling: an asyncio client with C slots and every request queued at once."""
    import aiohttp

    from pairforge.recaption.backends import data_url

    body = _body(data_url(_image(0)))

    async def main() -> None:
        slots = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            async def one() -> None:
                async with slots, session.post(base + "/v1/chat/completions",
                                               json=body) as response:
                    await response.read()

            await asyncio.gather(*(one() for _ in range(n)))

    asyncio.run(main())


def _image(i: int) -> Any:
    from PIL import Image

    return Image.new("RGB", (64, 64), (i % 251, (i // 251) % 251, 128))


def _rows(n: int) -> Any:
    import pyarrow as pa

    images = []
    for i in range(n):
        buffer = io.BytesIO()
        _image(i).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    keys = [f"{i:06d}" for i in range(n)]
    return pa.table({"key": keys, "status": ["ok"] * n, "caption": ["alt"] * n,
                     "image": images, "pixel_hash": [f"h{k}" for k in keys],
                     "phash": pa.array(range(n), pa.uint64())})


def run_step(base: str, n: int, concurrency: int, batch_size: int, pool_size: int) -> str:
    """The recaption step on Ray Data, as stage 3 places it; returns where the actors'
    ``pairforge`` came from."""
    import ray

    from pairforge.config import RayConfig, parse_config
    from pairforge.pipeline.placement import add_steps
    from pairforge.pipeline.ray_runtime import init_ray
    from pairforge.recaption.step import RecaptionStep

    cfg = parse_config({"input": {"path": "unused"}, "output": {"path": "/tmp/unused-out"},
                        "dedup": {"enabled": True},
                        "process": {"recaption": {
                            "enabled": True, "backend": "openai", "model": "served",
                            "batch_size": batch_size, "pool_size": pool_size,
                            "num_cpus": 0.5, "constrained_decoding": False,
                            "cache": {"enabled": False}, "grounding": {"enabled": False},
                            "openai": {"base_url": base + "/v1",
                                       "concurrency": concurrency}}}})
    init_ray(RayConfig(num_cpus=2, object_store_memory=500 * 1024**2))
    try:
        where = ray.get(ray.remote(lambda: __import__("pairforge").__file__).remote())
        ds = add_steps(ray.data.from_arrow(_rows(n)), [RecaptionStep], cfg,
                       {"recaption": 0.5})
        got = sum(len(b["key"]) for b in ds.iter_batches(batch_format="pyarrow",
                                                           batch_size=None))
        assert got == n, (got, n)
    finally:
        ray.shutdown()
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["bare", "step", "both"], default="both")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--pool-size", type=int, default=1)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    port = _free_port()
    ready = mp.get_context("spawn").Event()
    server = mp.get_context("spawn").Process(target=_serve, args=(port, ready), daemon=True)
    server.start()
    ready.wait(30)
    base = f"http://127.0.0.1:{port}"
    ceiling = args.concurrency / MEAN_LATENCY_S
    print(f"server: {FAST_S} s, every {SLOW_EVERY}th {SLOW_S} s (mean {MEAN_LATENCY_S:.2f} s); "
          f"C={args.concurrency}: C / mean latency = {ceiling:.1f}/s", flush=True)
    results = {}
    try:
        if args.mode in ("bare", "both"):
            run_bare(base, args.requests, args.concurrency)
            results["bare"] = summary(server_stats(base), args.concurrency)
            print("bare", json.dumps(results["bare"]), flush=True)
        if args.mode in ("step", "both"):
            where = run_step(base, args.requests, args.concurrency, args.batch_size,
                             args.pool_size)
            results["step"] = summary(server_stats(base), args.concurrency * args.pool_size)
            print(f"step (batch_size {args.batch_size}, pool_size {args.pool_size}, "
                  f"pairforge from {where})", json.dumps(results["step"]), flush=True)
        if len(results) == 2:
            ratio = (results["step"]["steady_requests_per_s"]
                     / results["bare"]["steady_requests_per_s"])
            print(f"step / bare steady requests/s: {ratio:.3f}")
    finally:
        server.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
