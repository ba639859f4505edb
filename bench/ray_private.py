"""What each private Ray API use buys (pairforge/pipeline/ray_private.py): runs with one
use switched off (``PAIRFORGE_RAY_PRIVATE_OFF``) next to runs with all of them on.

    python bench/ray_private.py start --repeats 8    # a driver: init_ray, 2 tasks, shutdown
    python bench/ray_private.py stage1 --repeats 3   # pairforge download, 10^4 rows, nginx
    python bench/ray_private.py tests --uses all -m "not slow" tests/test_process_stage.py

Each repeat runs, for every use in turn (the order rotated per repeat), a run with all uses
on and a run with that use off, adjacent, which first alternating per repeat; a use's gain
is the median over repeats of (off - on) for the pair. The machine is shared, so the
spread (min-max of the pairs) is printed beside each median. Wall seconds are the whole
command's; CPU seconds are summed over its process tree (bench/proctree.py). ``stage1``
serves the web-size photos of bench/photoset.py from nginx on 127.0.0.1
(bench/webhost.py) and runs ``pairforge download`` as bench/download.py does.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from download import make_input, pairforge_cmd  # noqa: E402
from photoset import describe, photo_set  # noqa: E402
from proctree import run_sampled  # noqa: E402
from webhost import start_hosts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pairforge.pipeline.ray_private import OFF_ENV, USES  # noqa: E402

# A driver's whole life with Ray as stage 1 lives it: start, a zero-CPU actor (the
# progress counter), two one-CPU tasks (the download slots), leave. Prints the seconds
# to the first results.
DRIVER = """\
import time
t0 = time.monotonic()
import ray
from pairforge.config import RayConfig
from pairforge.pipeline.ray_runtime import init_ray, shutdown_ray
init_ray(RayConfig(num_cpus=2))
counter = ray.remote(num_cpus=0)(type("Counter", (), {"add": lambda self: 1})).remote()
f = ray.remote(num_cpus=1)(lambda c: ray.get(c.add.remote()))
ray.get([f.remote(counter) for _ in range(2)])
print(round(time.monotonic() - t0, 3))
shutdown_ray()
"""


def measure(cmd: list[str], off: str, cwd: Path) -> tuple[float, float]:
    """(wall s, CPU s of the process tree) of ``cmd`` with ``off`` switched off."""
    env = {**os.environ, OFF_ENV: off, "PYTHONPATH": str(ROOT)}
    seconds, tree = run_sampled(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env, cwd=cwd)
    return seconds, tree.cpu_s


def compare(uses: list[str], repeats: int, run: callable) -> None:
    """Interleaved pairs (all on, ``use`` off) per use and repeat; prints each pair and
    then, per use, the medians and spreads of the differences."""
    deltas: dict[str, list[tuple[float, float]]] = {use: [] for use in uses}
    base: list[tuple[float, float]] = []
    for repeat in range(repeats):
        order = uses[repeat % len(uses):] + uses[:repeat % len(uses)]
        for use in order:
            sides = ["", use] if repeat % 2 == 0 else [use, ""]
            got = {side: run(side) for side in sides}
            (on_s, on_cpu), (off_s, off_cpu) = got[""], got[use]
            base.append(got[""])
            deltas[use].append((off_s - on_s, off_cpu - on_cpu))
            print(f"repeat {repeat} {use:12s} on {on_s:6.2f} s, {on_cpu:6.2f} CPU s | off "
                  f"{off_s:6.2f} s, {off_cpu:6.2f} CPU s | load {os.getloadavg()[0]:.1f}",
                  flush=True)
    walls = [b[0] for b in base]
    print(f"\nall on: median {statistics.median(walls):.2f} s "
          f"({min(walls):.2f}-{max(walls):.2f}), CPU "
          f"{statistics.median(b[1] for b in base):.2f} s; {len(base)} runs")
    for use, pairs in deltas.items():
        wall, cpu = [p[0] for p in pairs], [p[1] for p in pairs]
        print(f"{use:12s} off - on: wall {statistics.median(wall):+6.2f} s "
              f"({min(wall):+.2f} .. {max(wall):+.2f}), CPU {statistics.median(cpu):+6.2f} s "
              f"({min(cpu):+.2f} .. {max(cpu):+.2f}); {len(pairs)} pairs", flush=True)


def bench_start(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="pairforge-raypriv-") as tmp:
        compare(args.uses, args.repeats,
                lambda off: measure([sys.executable, "-c", DRIVER], off, Path(tmp)))


def bench_stage1(args: argparse.Namespace) -> None:
    folder = photo_set(args.photos)
    names = sorted(p.name for p in folder.glob("*.jpg"))
    hosts = start_hosts(folder, 1, "nginx")
    print(f"stage 1: {args.rows} rows, {hosts.server}; {describe(folder)}", flush=True)
    dl_args = argparse.Namespace(shard_size=1000, processes=2, threads=32)
    try:
        with tempfile.TemporaryDirectory(prefix="pairforge-raypriv-") as tmp:
            inp = Path(tmp) / "input.parquet"
            make_input(hosts.base_urls, names, args.rows, inp)
            out = Path(tmp) / "out"

            def run(off: str) -> tuple[float, float]:
                result = measure(pairforge_cmd(inp, out, dl_args, []), off, Path(tmp))
                subprocess.run(["rm", "-rf", str(out)], check=True)
                return result

            compare(args.uses, args.repeats, run)
    finally:
        hosts.close()


def bench_tests(args: argparse.Namespace) -> None:
    pytest = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
              *(["-m", args.marker] if args.marker else []), *args.files]
    # a test of a switched-off use fails (that is its job); the time still counts
    cmd = ["sh", "-c", shlex.join(pytest) + " || true"]
    compare(args.uses, args.repeats, lambda off: measure(cmd, off, ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["start", "stage1", "tests"])
    parser.add_argument("files", nargs="*", help="test files (tests)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--uses", default=",".join(USES + ("all",)),
                        help="the uses to switch off in turn (comma-separated; all: every one)")
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--photos", default="web")
    parser.add_argument("-m", dest="marker", help="tests: pytest's -m, e.g. 'not slow'")
    args = parser.parse_intermixed_args()
    args.uses = args.uses.split(",")
    print(f"{time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    {"start": bench_start, "stage1": bench_stage1, "tests": bench_tests}[args.what](args)


if __name__ == "__main__":
    main()
