"""Stage 1 on the urllib3 client, for bench/download.py's pairforge runs (issue 33, item 7).

With this folder on PYTHONPATH (Ray's workers inherit it) and
``PAIRFORGE_BENCH_FETCHER=urllib3``, every process that imports
``pairforge.download.shard`` finds ``Fetcher`` there replaced by bench/fetch_urllib3.py's
``Urllib3Fetcher``; nothing else is imported early, so the processes start as they would.
``PAIRFORGE_BENCH_FETCHER_MARK=FILE`` appends the pid of each process so patched, to check
that the shard tasks ran on it. Without the variable this file does nothing.

    PYTHONPATH=$PWD:$PWD/bench/fetcher_shim PAIRFORGE_BENCH_FETCHER=urllib3 \\
        python bench/download.py
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

_TARGET = "pairforge.download.shard"
_BENCH = str(Path(__file__).resolve().parent.parent)


def _patch(module) -> None:
    sys.path.insert(0, _BENCH)
    from fetch_urllib3 import Urllib3Fetcher

    module.Fetcher = Urllib3Fetcher
    mark = os.environ.get("PAIRFORGE_BENCH_FETCHER_MARK")
    if mark:
        with open(mark, "a") as handle:
            handle.write(f"{os.getpid()}\n")


class _PatchShardModule(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # the real finders locate the module
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module) -> None:
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("PAIRFORGE_BENCH_FETCHER") == "urllib3":
    sys.meta_path.insert(0, _PatchShardModule())
