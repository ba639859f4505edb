"""A shard task's memory guard: a row whose image still blows up ends that row, not the node.

``download/imageproc.py`` checks what one image may allocate against its caps before any
pixel is decoded; this is the net under those checks (a codec bug, a format they do not
model). A thread samples the task's resident memory every 50 ms. Past
``download.max_task_memory_mb`` it records the keys of the rows whose images are being
processed in ``OUT/raw/NNNNN.memory_guard.json`` and ends the process at once: no Python
exception stops C code in the middle of an allocation, and the kernel's OOM killer, or Ray's
node-wide memory monitor, would end other workers of the node with it. Ray runs the task
again (a dead worker is a system failure, retried ``ray.max_task_retries`` times), and the
retry ends those rows ``too_large`` with the reason instead of fetching them again. The file
is removed once the shard is complete; a run under other settings ignores it.

Only Linux gives the resident size cheaply (``/proc/self/statm``); elsewhere the guard is off.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pairforge.shards.raw import shard_name
from pairforge.shards.storage import RAW_FOLDER, OutputDir

_STATM = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
PERIOD_S = 0.05
EXIT_CODE = 75  # EX_TEMPFAIL: the task is to be run again


def guard_file(shard_id: int) -> str:
    # One file per shard (its parts share it): stale parts are removed by their name at the
    # start of a run, and the rows recorded here must outlive them.
    return f"{shard_name(shard_id)}.memory_guard.json"


def resident_bytes(fd: int | None = None) -> int | None:
    """The process's resident size; ``fd``: ``/proc/self/statm`` held open (``open_statm``),
    read again from its start: 20 us a sample where opening it each time took 80."""
    try:
        if fd is not None:
            return int(os.pread(fd, 128, 0).split()[1]) * _PAGE
        with open(_STATM, "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def open_statm() -> int | None:
    try:
        return os.open(_STATM, os.O_RDONLY)
    except OSError:
        return None


class GuardedRows:
    """The rows an earlier try of this shard's task was ended on, and their reasons."""

    def __init__(self, out: OutputDir, shard_id: int, settings: dict[str, Any]):
        self.out, self.name, self.settings = out, guard_file(shard_id), settings
        self.rows: dict[str, str] = {}
        if out.exists(RAW_FOLDER, self.name):
            recorded = out.read_json(RAW_FOLDER, self.name)
            if recorded.get("settings") == settings:  # made under other settings: retried
                self.rows = dict(recorded.get("rows", {}))

    def reason(self, key: str) -> str | None:
        return self.rows.get(key)

    def record(self, keys: list[str], reason: str) -> None:
        if self.out.exists(RAW_FOLDER, self.name):  # another part of the shard may have added
            recorded = self.out.read_json(RAW_FOLDER, self.name)
            if recorded.get("settings") == self.settings:
                self.rows.update(recorded.get("rows", {}))
        self.rows.update(dict.fromkeys(keys, reason))
        self.out.write_json({"settings": self.settings, "rows": self.rows},
                            RAW_FOLDER, self.name)

    def remove(self) -> None:
        self.out.remove(RAW_FOLDER, self.name)


class MemoryGuard:
    """Ends the process, after recording the rows in flight, once it holds over ``limit_mb``
    (None: only samples the peak)."""

    def __init__(self, limit_mb: int | None, rows: GuardedRows):
        self.limit = limit_mb * 2**20 if limit_mb else None
        self.rows = rows
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = resident_bytes()  # sampled: what the task held, for its stats

    @property
    def peak_mib(self) -> int | None:
        return None if self.peak is None else self.peak // 2**20

    def __enter__(self) -> MemoryGuard:
        if self.peak is not None:
            self._thread = threading.Thread(target=self._watch, name="memory-guard",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @contextmanager
    def processing(self, key: str) -> Iterator[None]:
        """Marks ``key``'s image as being processed for the length of the block."""
        with self._lock:
            self._in_flight.add(key)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.discard(key)

    def _watch(self) -> None:
        fd = open_statm()  # the thread's own: closed when it ends
        try:
            self._sample(fd)
        finally:
            if fd is not None:
                os.close(fd)

    def _sample(self, fd: int | None) -> None:
        # CPU per second of task: 2.6-3.0 ms opening statm at each sample, 1.7 with it
        # held open, 1.3-1.4 of that the wake-ups alone; at ~60 images/s a task, 0.03 ms
        # an image (bench/RESULTS.md, "Stage 1's CPU per image won back")
        while not self._stop.wait(PERIOD_S):
            held = resident_bytes(fd) or 0
            self.peak = max(self.peak or 0, held)
            if self.limit is not None and held > self.limit:
                with self._lock:
                    keys = sorted(self._in_flight)
                # Only an image pass is ended: memory held by anything else (the fetch
                # threads' bodies) would be held again on the retry, with no row to blame.
                if keys:
                    self._breach(held, keys)

    def _breach(self, held: int, keys: list[str]) -> None:
        reason = (f"the shard task passed download.max_task_memory_mb="
                  f"{self.limit // 2**20} ({held // 2**20} MiB resident) while this row's "
                  "image was processed; the task was ended and run again without it")
        try:
            self.rows.record(keys, reason)
        finally:
            print(f"pairforge memory guard: {held // 2**20} MiB resident, over "
                  f"{self.limit // 2**20}; rows in flight {keys}; ending the task",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)
