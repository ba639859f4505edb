"""CPU and memory of a whole process tree (a tool's driver and every worker it starts).

``TreeSampler(pid)`` reads ``/proc/*/stat`` every ``interval`` seconds in a thread: the
sum of resident memory over ``pid`` and its descendants (its peak is the figure "peak RSS
of the whole run"; shared pages are counted once per process, as RSS does), and each
process's cumulative CPU time, kept at its last value so processes that exit still count
(up to one interval of their CPU can be missed).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Proc:
    name: str
    cpu_s: float = 0.0
    peak_rss: int = 0


def _read_stat(pid: int) -> tuple[str, int, float, int] | None:
    """(name, ppid, cpu seconds, rss bytes) of one process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes().decode("utf-8", "replace")
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
            stat = _read_stat(int(entry.name))
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
    return sum(s[2] for p in pids if (s := _read_stat(p)) is not None)


def run_sampled(cmd: list[str], interval: float = 0.2, **popen) -> tuple[float, TreeSampler]:
    """Run ``cmd`` to its end; (wall seconds, its sampler). Raises on a non-zero exit."""
    import subprocess

    start = time.perf_counter()
    proc = subprocess.Popen(cmd, **popen)
    with TreeSampler(proc.pid, interval) as sampler:
        code = proc.wait()
    seconds = time.perf_counter() - start
    if code:
        raise subprocess.CalledProcessError(code, cmd)
    return seconds, sampler
