"""What the local machine offers this process."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on: a container's or taskset's CPU set, not the
    host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS, Windows)
        return os.cpu_count() or 1
