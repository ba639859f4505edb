"""What the benchmarks share: where things are, the command line's shape, this process's
memory, CPU per item, fresh driver processes, photo sets at web sizes, loopback image hosts
(nginx), and the CPU and memory of a whole process tree.

A script run as ``python bench/NAME.py`` has bench/ on ``sys.path`` and imports this as
``common``; one loaded from elsewhere (tests/test_ablation.py loads bench/ablation.py by
path) puts bench/ there first.

Photo sets: the 399 COCO sample photos are at most 300 px; real web images are mostly
larger, and decoding cost grows with pixels. ``photo_set`` re-encodes every photo with its
longer side at a size drawn (seeded) from 640-2,048 px, or at one fixed size, as JPEG q90,
into a cache folder under the system temp dir (world-readable, so nginx's worker can serve
it). The photos are upscales, so they compress better than camera photos of the same size;
decode time follows the pixel count more than the bytes. Upscales have no detail finer
than the 300 px originals, so they flatter anything that throws detail away (a coarser
decode scale, a cheaper filter). ``mosaic`` is a set with camera detail at 1,280 px:
1,280x960 mosaics of 5x5 photos at their own resolution (the centre 256x192 of landscape
photos), photos drawn seeded, JPEG q90.

Image hosts: nginx (Debian's ``nginx-light``: ``apt-get install -y nginx-light``) is
started from a temporary config, in the foreground (``daemon off``) as a child of this
process, with its pid file, logs and temp paths in a temporary folder: no system service
is touched. It runs one worker with ``sendfile on; tcp_nodelay on;`` and nginx's
keep-alive defaults, and listens on 127.0.0.1 .. 127.0.0.N (every 127/8 address is the
loopback interface on Linux), so a URL list can spread over N hosts. When nginx is
missing, the Python ``serve_directory`` (one per address, in one child process) stands in,
and ``Hosts.server`` says which one served.

Process trees: ``TreeSampler(pid)`` reads ``/proc/*/stat`` every ``interval`` seconds in a
thread: the sum of resident memory over ``pid`` and its descendants (its peak is the figure
"peak RSS of the whole run"; shared pages are counted once per process, as RSS does), and
each process's cumulative CPU time, kept at its last value so processes that exit still
count (up to one interval of their CPU can be missed).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
TESTS = REPO / "tests"  # the tiny random-weight models and references the tests share
SAMPLE = REPO / "pairforge" / "sample"  # the bundled scene world: images, captioner, VQ
DATA = REPO.parent / "shared" / "data"  # ../shared/data: the COCO sample, alt-texts
COCO = DATA / "coco-sample"  # images/ and captions.csv
COCO_IMAGES = COCO / "images"


def arg_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser; ``--help`` shows its whole docstring (the question it answers)."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def pairforge_cli(*args: str) -> str:
    """``pairforge ARGS`` as a user runs it; its stdout. Exits with its output on failure."""
    run = subprocess.run([sys.executable, "-m", "pairforge.cli", *args], capture_output=True,
                         text=True)
    if run.returncode:
        raise SystemExit(f"pairforge {' '.join(args)} failed:\n{run.stdout}\n{run.stderr}")
    return run.stdout


# ---------------------------------------------------------------- this process's memory
def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM, which a new program image starts afresh. (Not
    getrusage's ru_maxrss: Linux carries it over fork and exec, so a child reports at
    least its parent's peak.)"""
    try:
        return _status_mib("VmHWM")
    except (OSError, StopIteration):
        return max_rss_mib()


def rss_mib() -> float:
    """This process's resident memory now (VmRSS)."""
    return _status_mib("VmRSS")


def max_rss_mib() -> float:
    """getrusage's ru_maxrss: the peak since the process's fork, its parent's included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# The same reading as an expression, for driver code that runs as ``python -c``.
PEAK_RSS_EXPR = "int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) / 1024"


# -------------------------------------------------------------------------- timing
def best_cpu_ms(fn: Callable[[Any], object], items: list, repeats: int) -> float:
    """Best process-CPU ms per item over ``repeats`` passes: the whole process's clock, so
    work on helper threads (libvips' worker, torch's pool) counts, and on a shared machine
    other work only ever slows a pass."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for item in items:
            fn(item)
        best = min(best, (time.process_time() - start) / len(items) * 1e3)
    return best


# ------------------------------------------------------------------ fresh driver processes
def child_env() -> dict[str, str]:
    """The environment of a fresh driver: this checkout's pairforge, after any PYTHONPATH
    the caller set (to measure another tree)."""
    paths = [p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def json_from_child(args: list[str], what: str = "the driver",
                    timeout: float | None = None) -> dict[str, Any]:
    """Run ``python ARGS`` in a fresh interpreter (its own peak RSS); the JSON object of
    its last line of output. Raises with its stderr's tail when it fails."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=child_env(), timeout=timeout, check=False)
    if done.returncode:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------- photo sets
CACHE = Path(tempfile.gettempdir()) / "pairforge-bench"
QUALITY = 90
MOSAIC_TILE, MOSAIC_GRID, MOSAICS = (256, 192), 5, 80


def spec_name(spec: str) -> str:
    """``coco`` (as shipped), ``web`` (640-2,048 px), ``mosaic`` or a size like ``1280``."""
    if spec not in ("coco", "web", "mosaic") and not spec.isdigit():
        raise ValueError(f"photo set {spec!r}: coco, web, mosaic or a size in px")
    return spec


def _longer_side(spec: str, rng: random.Random) -> int:
    return rng.randint(640, 2048) if spec == "web" else int(spec)


def _reencode(source: Path, side: int) -> bytes:
    from PIL import Image

    image = Image.open(source).convert("RGB")
    scale = side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    buffer = io.BytesIO()
    image.resize(size, Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def _mosaic(sources: list[Path]) -> bytes:
    from PIL import Image

    (tile_w, tile_h), grid = MOSAIC_TILE, MOSAIC_GRID
    canvas = Image.new("RGB", (tile_w * grid, tile_h * grid))
    for i, path in enumerate(sources):
        image = Image.open(path).convert("RGB")
        left, top = (image.width - tile_w) // 2, (image.height - tile_h) // 2
        tile = image.crop((left, top, left + tile_w, top + tile_h))
        canvas.paste(tile, (i % grid * tile_w, i // grid * tile_h))
    buffer = io.BytesIO()
    canvas.save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def _mosaic_set(source: Path, folder: Path) -> None:
    from PIL import Image

    wide = [p for p in sorted(source.glob("*.jpg"))
            if all(a >= b for a, b in zip(Image.open(p).size, MOSAIC_TILE, strict=True))]
    rng = random.Random(0)
    for i in range(MOSAICS):
        target = folder / f"mosaic_{i:03d}.jpg"
        target.write_bytes(_mosaic(rng.sample(wide, MOSAIC_GRID * MOSAIC_GRID)))
        os.chmod(target, 0o644)


def _reencoded_set(spec: str, source: Path, folder: Path) -> None:
    rng = random.Random(0)
    for path in sorted(source.glob("*.jpg")):
        target = folder / path.name
        target.write_bytes(_reencode(path, _longer_side(spec, rng)))
        os.chmod(target, 0o644)


def photo_set(spec: str = "web", source: Path = COCO_IMAGES) -> Path:
    """The folder of the set's photos (the COCO sample's names; ``mosaic_N.jpg`` for
    mosaics), made if missing."""
    spec = spec_name(spec)
    if spec == "coco":
        return source
    folder = CACHE / f"photos-{spec}"
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for path in (CACHE, folder):
        os.chmod(path, 0o755)
    if spec == "mosaic":
        _mosaic_set(source, folder)
    else:
        _reencoded_set(spec, source, folder)
    done.touch()
    return folder


def describe(folder: Path) -> str:
    """``N photos, longer side A-B px (median M), mean K KB``."""
    from PIL import Image

    files = sorted(folder.glob("*.jpg"))
    sides = sorted(max(Image.open(f).size) for f in files)
    kb = sum(f.stat().st_size for f in files) / len(files) / 1024
    return (f"{len(files)} photos, longer side {sides[0]}-{sides[-1]} px "
            f"(median {sides[len(sides) // 2]}), mean {kb:.0f} KB")


# ------------------------------------------------------------------------ image hosts
NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    sendfile on;
    tcp_nodelay on;
    types {{ image/jpeg jpg; }}
    default_type application/octet-stream;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
{listens}
        root {root};
    }}
}}
"""


@dataclass
class Hosts:
    server: str  # "nginx 1.22.1" or "serve_directory (Python)"
    base_urls: list[str]  # one per loopback host
    pids: list[int] = field(default_factory=list)  # the server's processes (for CPU and RSS)
    _stop: list = field(default_factory=list, repr=False)

    def close(self) -> None:
        for stop in reversed(self._stop):
            stop()
        self._stop.clear()


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def addresses(n_hosts: int) -> list[str]:
    if not 1 <= n_hosts <= 254:
        raise ValueError("between 1 and 254 loopback hosts")
    return [f"127.0.0.{i}" for i in range(1, n_hosts + 1)]


def _check_readable(root: Path) -> None:
    """nginx's worker runs as nobody when started by root: every folder up to the images
    must be world-traversable and the files world-readable."""
    for folder in [root, *root.parents]:
        if not os.stat(folder).st_mode & 0o001:
            raise PermissionError(f"{folder} is not traversable by nginx's worker; "
                                  "put the images under a world-readable folder")


def start_nginx(root: Path, n_hosts: int, binary: str) -> Hosts:
    _check_readable(root)
    tmp = Path(tempfile.mkdtemp(prefix="pairforge-nginx-"))
    port = free_port()
    listens = "\n".join(f"        listen {a}:{port};" for a in addresses(n_hosts))
    (tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp, listens=listens, root=root))
    version = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr.strip()
    proc = subprocess.Popen([binary, "-p", str(tmp), "-c", str(tmp / "nginx.conf"),
                             "-e", str(tmp / "error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop() -> None:
        proc.send_signal(signal.SIGQUIT)  # graceful: the master stops its worker
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    hosts = Hosts(f"nginx {version.split('/')[-1]}",
                  [f"http://{a}:{port}" for a in addresses(n_hosts)], _stop=[stop])
    try:
        _wait_listening(addresses(n_hosts), port, proc, tmp)
        hosts.pids = [proc.pid, *_children(proc.pid)]
    except BaseException:
        hosts.close()
        raise
    return hosts


def _wait_listening(hosts: list[str], port: int, proc: subprocess.Popen, tmp: Path) -> None:
    deadline = time.monotonic() + 10
    pending = list(hosts)
    while pending:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited: {(tmp / 'error.log').read_text()[-2000:]}")
        try:
            socket.create_connection((pending[0], port), timeout=1).close()
            pending.pop(0)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not listen on {pending[0]}:{port}") from None
            time.sleep(0.05)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _serve(root: str, hosts: list[str], queue: mp.Queue) -> None:
    from contextlib import ExitStack

    from pairforge.download.folder_server import serve_directory

    with ExitStack() as stack:
        queue.put([stack.enter_context(serve_directory(root, host)) for host in hosts])
        while True:
            time.sleep(3600)


def start_python_server(root: Path, n_hosts: int) -> Hosts:
    """The fallback: threaded HTTP/1.1 servers in one child process (its own GIL)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(str(root), addresses(n_hosts), queue),
                       daemon=True)
    proc.start()

    def stop() -> None:
        proc.terminate()
        proc.join(10)

    return Hosts("serve_directory (Python)", queue.get(timeout=60), [proc.pid], [stop])


def start_hosts(root: Path, n_hosts: int = 1, prefer: str = "nginx") -> Hosts:
    """nginx if asked and installed, else the Python server, on ``n_hosts`` addresses."""
    binary = nginx_binary() if prefer == "nginx" else None
    if binary:
        return start_nginx(root, n_hosts, binary)
    if prefer == "nginx":
        print("nginx not found (apt-get install -y nginx-light): using serve_directory")
    return start_python_server(root, n_hosts)


# ---------------------------------------------------------------------- process trees
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Proc:
    name: str
    cpu_s: float = 0.0
    peak_rss: int = 0


def read_stat(path: Path) -> tuple[str, int, float, int] | None:
    """(name, ppid, cpu seconds, rss bytes) from a ``/proc/.../stat`` file (a process's or
    a thread's), or None when it is gone."""
    try:
        text = path.read_bytes().decode("utf-8", "replace")
    except OSError:
        return None
    # comm is in parentheses and may hold spaces; the fields after it are fixed.
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    ppid, utime, stime, rss = int(fields[1]), int(fields[11]), int(fields[12]), int(fields[21])
    return name, ppid, (utime + stime) / _TICK, rss * _PAGE


def snapshot() -> dict[int, tuple[str, int, float, int]]:
    stats = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = read_stat(Path(f"/proc/{entry.name}/stat"))
            if stat is not None:
                stats[int(entry.name)] = stat
    return stats


def descendants(root: int, stats: dict[int, tuple[str, int, float, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            found.append(pid)
        todo.extend(children.get(pid, []))
    return found


@dataclass
class TreeSampler:
    root: int
    interval: float = 0.2
    peak_rss: int = 0
    procs: dict[int, _Proc] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        stats = snapshot()
        total = 0
        for pid in descendants(self.root, stats):
            name, _, cpu, rss = stats[pid]
            proc = self.procs.setdefault(pid, _Proc(name))
            proc.name, proc.cpu_s = name, max(proc.cpu_s, cpu)  # Ray renames its workers
            proc.peak_rss = max(proc.peak_rss, rss)
            total += rss
        self.peak_rss = max(self.peak_rss, total)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeSampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    @property
    def cpu_s(self) -> float:
        return sum(p.cpu_s for p in self.procs.values())

    def cpu_by_name(self) -> Counter:
        """CPU seconds per process name (Ray names its task workers ``ray::TASK``)."""
        by_name: Counter = Counter()
        for proc in self.procs.values():
            by_name[proc.name] += proc.cpu_s
        return by_name


def cpu_seconds(pids: list[int]) -> float:
    """Cumulative CPU of some processes (e.g. the web server's), now."""
    return sum(s[2] for p in pids if (s := read_stat(Path(f"/proc/{p}/stat"))) is not None)


def run_sampled(cmd: list[str], interval: float = 0.2, **popen) -> tuple[float, TreeSampler]:
    """Run ``cmd`` to its end; (wall seconds, its sampler). Raises on a non-zero exit."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, **popen)
    with TreeSampler(proc.pid, interval) as sampler:
        code = proc.wait()
    seconds = time.perf_counter() - start
    if code:
        raise subprocess.CalledProcessError(code, cmd)
    return seconds, sampler
