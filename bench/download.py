"""Stage 1 against img2dataset: the same nginx, the same input, the same resize and workers.

    python bench/download.py                       # one host, photos at 640-2,048 px
    python bench/download.py --hosts 16            # nginx on 127.0.0.1 .. 127.0.0.16
    python bench/download.py --photos 1280 --rows 5000 --hosts 16
    python bench/download.py --set download.per_host_connections=64
    python bench/download.py --setups --repeats 2  # the four setups of issue 18
    python bench/download.py --only pairforge --rows 100000   # peak RSS at 10^5 rows
    python bench/download.py --consent --repeats 3  # robots.txt + tdmrep.json served, allow all

Prerequisite: nginx (``apt-get update && apt-get install -y nginx-light``). The bench starts
it itself from a temporary config (bench/common.py: no system service, one worker,
``sendfile on; tcp_nodelay on;``); without nginx it falls back to the Python
``serve_directory`` and says so. The photos are the COCO sample of
../shared/data re-encoded at web sizes (bench/common.py, cached under the temp dir):
``--photos web`` draws each longer side from 640-2,048 px, a number fixes it, ``coco``
serves them as shipped (at most 300 px). The captions are the 10,000 real alt-texts of
alttext-10k.parquet, repeated for more rows.

Both tools run as a new user runs them, as whole commands: ``img2dataset`` 1.47.0 from its
own virtual environment (bench/.venv-img2dataset, made on first use; it pins an older
webdataset) and ``pairforge download`` at its defaults (local Ray started and stopped by
the command), with 2 processes x 32 threads, shards of 1,000 rows, keep_ratio 256 jpg q95,
no retries, timeout 10 s; pairforge's allow-list is 127.0.0.0/8. Their runs alternate,
in turn first, so both see the same load on a shared machine. For each run: images/s of
the whole command, CPU ms per image summed over the whole process tree (driver and every
worker), the web server's CPU, and the peak of the process tree's summed RSS (sampled
every 0.2 s). pairforge computes sha256, the pixel hash and the perceptual hash;
img2dataset sha256 only.

``--consent`` serves a robots.txt and a tdmrep.json that allow everything and runs pairforge
twice per repeat, adjacent to img2dataset: with robots.txt and TDM checks off
(``pairforge-off``, the stage as it was before issue 36) and at its defaults, which fetch
and obey both files (``pairforge``), so the cost of consent shows as the change of the
ratio against img2dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from common import (
    BENCH,
    DATA,
    arg_parser,
    cpu_seconds,
    describe,
    photo_set,
    run_sampled,
    start_hosts,
)

I2D_VENV = BENCH / ".venv-img2dataset"
I2D_PYTHON = I2D_VENV / "bin" / "python"
I2D_VERSION = "img2dataset==1.47.0"
TOOLS = ("img2dataset", "pairforge")
CONSENT_OFF = ["download.robots_txt=false", "download.tdm=false"]
ALLOW_ALL = {"robots.txt": "User-agent: *\nAllow: /\n", ".well-known/tdmrep.json": "[]\n"}

# The four setups of issue 18: (name, hosts, photos, rows, pairforge --set overrides).
SETUPS = [
    ("one host, defaults", 1, "web", 10_000, []),
    ("one host, per_host_connections 64", 1, "web", 10_000,
     ["download.per_host_connections=64"]),
    ("16 hosts, defaults", 16, "web", 10_000, []),
    ("16 hosts, 1,280 px photos", 16, "1280", 5_000, []),
]


@dataclass
class Run:
    tool: str
    ok: int
    rows: int
    seconds: float
    cpu_s: float  # the tool's whole process tree
    server_cpu_s: float
    peak_rss: int
    top: list[tuple[str, float]]  # CPU seconds of the busiest process names
    tail_s: float  # from the end of the last full round of shards to the last shard's end

    @property
    def rate(self) -> float:
        return self.ok / self.seconds  # images/s

    @property
    def cpu_per_image(self) -> float:
        return self.cpu_s / self.ok  # seconds

    def line(self) -> str:
        top = ", ".join(f"{name} {s:.1f}" for name, s in self.top)
        return (f"{self.tool:12s}: {self.ok:6d}/{self.rows} ok in {self.seconds:6.2f} s = "
                f"{self.rate:6.1f} images/s; CPU {self.cpu_per_image * 1e3:5.2f} "
                f"ms/image (server {self.server_cpu_s / self.ok * 1e3:.2f}); peak RSS "
                f"{self.peak_rss / 2**20:6.0f} MiB; tail {self.tail_s:4.1f} s; CPU s by "
                f"process: {top}")


def ensure_img2dataset() -> None:
    if not I2D_PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(I2D_VENV)], check=True)
        subprocess.run([str(I2D_PYTHON), "-m", "pip", "install", "-q", I2D_VERSION], check=True)


def make_input(base_urls: list[str], names: list[str], rows: int, path: Path) -> None:
    """``rows`` alt-text captions, URL i on host i mod N, photo i mod the set's size."""
    alt = pq.read_table(DATA / "alttext-10k.parquet", columns=["TEXT"])["TEXT"].to_pylist()
    captions = [alt[i % len(alt)] for i in range(rows)]
    urls = [f"{base_urls[i % len(base_urls)]}/{names[i % len(names)]}" for i in range(rows)]
    pq.write_table(pa.table({"URL": urls, "TEXT": captions}), path)


def img2dataset_cmd(inp: Path, out: Path, args: argparse.Namespace) -> list[str]:
    return [str(I2D_PYTHON), "-m", "img2dataset.main", "--url_list", str(inp),
            "--input_format", "parquet", "--url_col", "URL", "--caption_col", "TEXT",
            "--output_format", "webdataset", "--output_folder", str(out),
            "--processes_count", str(args.processes), "--thread_count", str(args.threads),
            "--number_sample_per_shard", str(args.shard_size),
            "--image_size", "256", "--resize_mode", "keep_ratio",
            "--encode_format", "jpg", "--encode_quality", "95", "--timeout", "10",
            "--retries", "0", "--distributor", "multiprocessing", "--enable_wandb", "False"]


def pairforge_cmd(inp: Path, out: Path, args: argparse.Namespace,
                  overrides: list[str]) -> list[str]:
    pairforge = Path(sys.executable).with_name("pairforge")
    sets = [f"input.path={inp}", f"output.path={out}", f"input.shard_size={args.shard_size}",
            f"download.processes={args.processes}", f"download.threads={args.threads}",
            *overrides]
    return [str(pairforge), "download", str(BENCH / "dl.yaml"), "-q",
            *[arg for s in sets for arg in ("--set", s)]]


def shard_stats(out: Path) -> list[dict]:
    """Every shard's stats file (both tools write ``*_stats.json`` beside each tar)."""
    return [json.loads(p.read_text()) for p in out.glob("**/*_stats.json")]


def tail_seconds(stats: list[dict], processes: int) -> float:
    """Seconds in which fewer shards ran than processes at the end of the run: from the end
    of the ``processes``-th last shard to the end of the last."""
    ends = sorted(s["end_time"] for s in stats)
    return ends[-1] - ends[-processes] if len(ends) >= processes else 0.0


def run_tool(tool: str, inp: Path, out: Path, rows: int, server_pids: list[int],
             args: argparse.Namespace, overrides: list[str]) -> Run:
    if tool == "pairforge-off":
        overrides = [*overrides, *CONSENT_OFF]
    cmd = (img2dataset_cmd(inp, out, args) if tool == "img2dataset"
           else pairforge_cmd(inp, out, args, overrides))
    server_before = cpu_seconds(server_pids)
    # albumentations (an img2dataset dependency) asks PyPI for a newer version at import:
    # off, so the bench's traffic stays on loopback
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"}
    seconds, tree = run_sampled(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env)
    server = cpu_seconds(server_pids) - server_before
    top = tree.cpu_by_name().most_common(8)
    if args.verbose:
        for pid, proc in sorted(tree.procs.items(), key=lambda kv: -kv[1].cpu_s):
            print(f"    {pid:8d} {proc.name:16s} {proc.cpu_s:6.2f} s CPU, "
                  f"peak RSS {proc.peak_rss / 2**20:5.0f} MiB")
    stats = shard_stats(out)
    run = Run(tool, sum(s["successes"] for s in stats), rows, seconds, tree.cpu_s, server,
              tree.peak_rss, top, tail_seconds(stats, args.processes))
    shutil.rmtree(out, ignore_errors=True)
    return run


def run_setup(name: str, hosts_n: int, photos: str, rows: int, overrides: list[str],
              args: argparse.Namespace) -> list[Run]:
    folder = photo_set(photos)
    names = sorted(p.name for p in folder.glob("*.jpg"))
    consent_files = [folder / name for name in ALLOW_ALL] if args.consent else []
    for path in consent_files:
        path.parent.mkdir(exist_ok=True)
        path.write_text(ALLOW_ALL[str(path.relative_to(folder))])
    hosts = start_hosts(folder, hosts_n, args.server)
    load = os.getloadavg()[0]
    print(f"\n## {name}: {rows} rows, {hosts_n} host(s), {hosts.server}; {describe(folder)}; "
          f"pairforge --set {overrides or '(none)'}; load average {load:.1f}", flush=True)
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="pairforge-bench-") as tmp:
            inp = Path(tmp) / "input.parquet"
            make_input(hosts.base_urls, names, rows, inp)
            tools = [t for t in TOOLS if args.only in (None, t)]
            if args.consent:
                tools.insert(1, "pairforge-off")
            for repeat in range(args.repeats):
                order = tools if repeat % 2 == 0 else tools[::-1]
                for tool in order:
                    run = run_tool(tool, inp, Path(tmp) / tool, rows, hosts.pids, args,
                                   overrides)
                    print(run.line(), flush=True)
                    runs.append(run)
    finally:
        hosts.close()
        for path in consent_files:
            path.unlink()
    summarise(runs, len(tools))
    return runs


def summarise(runs: list[Run], per_repeat: int = 2) -> None:
    """Median images/s and CPU ms per image per tool and, with img2dataset, their ratios."""
    rates, cpus = {}, {}
    for tool in dict.fromkeys(r.tool for r in runs):
        mine = [r for r in runs if r.tool == tool]
        if mine:
            rates[tool] = sorted(r.rate for r in mine)[len(mine) // 2]
            cpus[tool] = sorted(r.cpu_per_image for r in mine)[len(mine) // 2]
    if "img2dataset" not in rates:
        return
    # The machine's speed drifts over minutes; the runs of one repeat are adjacent in time,
    # so their ratios are the comparison that drift disturbs least.
    repeats = [{r.tool: r for r in runs[i:i + per_repeat]}
               for i in range(0, len(runs) - per_repeat + 1, per_repeat)]
    for tool in [t for t in rates if t != "img2dataset"]:
        print(f"ratio {tool}/img2dataset (medians of {len(repeats)} run(s) each): "
              f"images/s {rates[tool] / rates['img2dataset']:.2f}x, "
              f"CPU per image {cpus['img2dataset'] / cpus[tool]:.2f}x less", flush=True)
        speed = [p[tool].rate / p["img2dataset"].rate for p in repeats]
        cpu = [p["img2dataset"].cpu_per_image / p[tool].cpu_per_image for p in repeats]
        print("  per repeat (adjacent runs): images/s "
              + ", ".join(f"{x:.2f}x" for x in speed) + "; CPU per image "
              + ", ".join(f"{x:.2f}x" for x in cpu), flush=True)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--photos", default="web", help="web (640-2,048 px), coco, or px")
    parser.add_argument("--set", action="append", default=[], dest="overrides",
                        help="a pairforge config override (repeatable)")
    parser.add_argument("--setups", action="store_true", help="the four setups of issue 18")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--only", choices=TOOLS)
    parser.add_argument("--server", choices=["nginx", "python"], default="nginx")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--verbose", action="store_true", help="CPU and RSS per process")
    parser.add_argument("--consent", action="store_true",
                        help="serve allow-all robots.txt/tdmrep.json; pairforge with and "
                             "without its consent checks")
    args = parser.parse_args()
    if args.only != "pairforge":
        ensure_img2dataset()
    print(f"{time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} CPUs; "
          f"{args.processes} processes x {args.threads} threads, shards of {args.shard_size}, "
          "keep_ratio 256 jpg q95")
    setups = SETUPS if args.setups else [
        ("custom", args.hosts, args.photos, args.rows, args.overrides)]
    for setup in setups:
        run_setup(*setup, args)


if __name__ == "__main__":
    main()
