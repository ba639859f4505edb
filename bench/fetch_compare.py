"""fetch.py's HTTP client against urllib3 (bench/fetch_urllib3.py), alone, on nginx.

    python bench/fetch_compare.py                        # 1 host, web-size photos, 32 threads
    python bench/fetch_compare.py --hosts 16 --repeats 6
    python bench/fetch_compare.py --per-host 64
    python bench/fetch_compare.py --shard --requests 1000   # stage 1's shard task, no Ray

Both clients fetch the same URLs (photo i mod the set on host i mod N, nginx on 127.0.0.x
as bench/download.py starts it; photos from bench/common.py) through one ``Fetcher``
shared by ``--threads`` threads, the stage's default of 32, with the stage's defaults
otherwise (``per_host_connections`` 8, allow-list 127.0.0.0/8). Each run makes a new
fetcher (so both pay their connections' setup) and reads every body. Runs alternate, the
first client of each repeat alternating too. Per run: requests/s (wall) and CPU ms per
request of this process (every thread: the client's whole cost, as a shard task pays it),
then the medians, the spread and the ratio of each repeat's adjacent runs.

``--shard``: instead of bare fetches, stage 1's whole task for one shard of the URLs
(``download_shard`` in this process, no Ray: fetch, image pass, tar and parquet; the
config of bench/dl.yaml, as bench/download.py runs it, at ``download.threads`` 32) with
each client in turn: the fetcher's share of the stage's CPU, without Ray's noise.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from common import BENCH, arg_parser, describe, photo_set, start_hosts
from fetch_urllib3 import Urllib3Fetcher

from pairforge.config import DownloadConfig, load_config  # noqa: E402
from pairforge.download import shard as shard_module  # noqa: E402
from pairforge.download.fetch import Fetcher  # noqa: E402
from pairforge.pipeline.contract import shard_config  # noqa: E402
from pairforge.pipeline.download_stage import input_shards  # noqa: E402
from pairforge.pipeline.settings import settings_record, stage_settings  # noqa: E402

CLIENTS = {"fetch.py": Fetcher, "urllib3": Urllib3Fetcher}


def one_run(client: type[Fetcher], cfg: DownloadConfig, urls: list[str],
            threads: int) -> tuple[float, float, int]:
    """(requests/s, CPU ms per request, bodies received) of one fetcher over ``urls``."""
    with client(cfg) as fetcher, ThreadPoolExecutor(threads) as pool:
        cpu, wall = time.process_time(), time.perf_counter()
        results = list(pool.map(fetcher.fetch, urls))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ok = sum(r.body is not None for r in results)
    return ok / wall, cpu / len(urls) * 1e3, ok


def one_shard(client: type[Fetcher], urls: list[str], tmp: Path, run: int,
              per_host: int) -> tuple[float, float, int]:
    """(images/s, CPU ms per image, ok rows) of ``download_shard`` over ``urls``."""
    inp = tmp / "in.parquet"
    if not inp.exists():
        captions = [f"a photo, {i}" for i in range(len(urls))]
        pq.write_table(pa.table({"URL": urls, "TEXT": captions}), inp)
    cfg = load_config(BENCH / "dl.yaml", [
        f"input.path={inp}", f"output.path={tmp / f'out{run}'}",
        f"input.shard_size={len(urls)}", f"download.per_host_connections={per_host}"])
    shard_module.Fetcher = client  # what download_shard constructs
    try:
        with input_shards(cfg) as shards:
            settings = settings_record(stage_settings(cfg, "download"))
            cpu, wall = time.process_time(), time.perf_counter()
            stats = shard_module.download_shard(shards[0], shard_config(cfg), settings)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        shard_module.Fetcher = Fetcher
    ok = stats["successes"]
    return ok / wall, cpu / len(urls) * 1e3, ok


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--photos", default="web", help="web (640-2,048 px), coco, or px")
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--per-host", type=int, default=8, help="per_host_connections")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shard", action="store_true",
                        help="stage 1's task for one shard of the URLs (no Ray), per client")
    args = parser.parse_args()
    folder = photo_set(args.photos)
    names = sorted(p.name for p in folder.glob("*.jpg"))
    hosts = start_hosts(folder, args.hosts)
    cfg = DownloadConfig(allow_addresses=["127.0.0.0/8"], per_host_connections=args.per_host)
    urls = [f"{hosts.base_urls[i % len(hosts.base_urls)]}/{names[i % len(names)]}"
            for i in range(args.requests)]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}; {args.requests} requests, {args.hosts} "
          f"host(s), {hosts.server}; {describe(folder)}; {args.threads} threads, "
          f"per_host_connections {args.per_host}; load average {os.getloadavg()[0]:.1f}")
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CLIENTS}
    unit = "images" if args.shard else "requests"
    try:
        with tempfile.TemporaryDirectory(prefix="pairforge-fetch-") as tmp:
            for repeat in range(args.repeats):
                order = list(CLIENTS) if repeat % 2 == 0 else list(CLIENTS)[::-1]
                for name in order:
                    if args.shard:
                        rate, cpu_ms, ok = one_shard(CLIENTS[name], urls, Path(tmp),
                                                     len(runs[name]) * 2 + (name == "urllib3"),
                                                     args.per_host)
                    else:
                        rate, cpu_ms, ok = one_run(CLIENTS[name], cfg, urls, args.threads)
                    runs[name].append((rate, cpu_ms))
                    print(f"  {repeat}: {name:8s} {rate:7.1f} {unit}/s, {cpu_ms:.3f} ms CPU "
                          f"per {unit[:-1]} ({ok}/{len(urls)} ok)", flush=True)
    finally:
        hosts.close()
    for name, mine in runs.items():
        rates, cpus = [r for r, _ in mine], [c for _, c in mine]
        print(f"{name:8s}: median {statistics.median(rates):7.1f} {unit}/s "
              f"({min(rates):.1f}-{max(rates):.1f}), {statistics.median(cpus):.3f} ms CPU per "
              f"{unit[:-1]} ({min(cpus):.3f}-{max(cpus):.3f})")
    pairs = list(zip(runs["fetch.py"], runs["urllib3"], strict=True))
    print(f"urllib3 / fetch.py per repeat: CPU per {unit[:-1]} "
          + ", ".join(f"{u[1] / f[1]:.2f}x" for f, u in pairs) + f"; {unit}/s "
          + ", ".join(f"{u[0] / f[0]:.2f}x" for f, u in pairs))


if __name__ == "__main__":
    main()
