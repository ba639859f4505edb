"""A stage process that finished its work must exit 0 every time (issue 48, "clean exit").

    python bench/clean_exit.py [--runs 200]

Runs a fresh Python process ``--runs`` times that reads one shard's key range of a
10^6-row duplicates table the way stage 3's reading task does (``plan.Decisions.of_shard``,
``tables.read_key_range``) and counts the runs that did not exit 0. Before
``read_key_range`` read through ``ParquetFile`` (it filtered with ``pq.read_table``, i.e.
pyarrow.dataset), 6 of 36 such runs aborted at exit with "terminate called without an
active exception" (bench/scale.py's ``shards`` driver had died the same way once).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from common import arg_parser

from pairforge.dedup.decide import DUPLICATES_SCHEMA
from pairforge.records import make_key

READER = """
import sys
from pairforge.pipeline.plan import Decisions
assert Decisions((sys.argv[1],)).of_shard(7)
"""


def duplicates_table(path: Path, rows: int = 10**6) -> None:
    dropped = np.sort(np.random.default_rng(0).choice(rows, rows // 10, replace=False))
    keys = [make_key(int(i) // 10_000, int(i) % 10_000) for i in dropped]
    pq.write_table(pa.table({
        "key": keys, "kind": ["duplicate_near"] * len(keys), "cluster_id": keys,
        "kept_key": keys, "kept_source": pa.nulls(len(keys), pa.string()),
        "distance": pa.array(np.ones(len(keys), np.int32))}, schema=DUPLICATES_SCHEMA), path)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "duplicates.parquet"
        duplicates_table(path)
        failed = 0
        for run in range(args.runs):
            done = subprocess.run([sys.executable, "-c", READER, str(path)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                failed += 1
                print(f"run {run}: exit {done.returncode}: {done.stderr.strip()[-200:]}")
    print(f"{args.runs} runs, {failed} did not exit 0")


if __name__ == "__main__":
    main()
