"""Opt-out and block lists at 10^7 entries (issue 36, item 3): load time, memory, and the
cost per row of a lookup (pairforge/download/lists.py).

    python bench/lists.py [--entries 10000000] [--phash 1000000] [--work DIR]

Writes an opt-out list of ``--entries`` lines (half domains, 40 % URLs, 10 % URL prefixes
of 60 distinct lengths), a sha256 block list of ``--entries`` hashes and a phash list of
``--phash`` hashes matched within 4 bits; then, in a fresh process each, loads them and
times lookups of 10^5 URLs (half listed) and 10^5 images' hashes. Peak RSS is the
process's VmHWM, less the interpreter and imports measured before loading.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import arg_parser, json_from_child, peak_rss_mib, rss_mib

LOOKUPS = 100_000


def _domain(i: int) -> str:
    return f"site{i}.example{i % 97}.com"


def write_lists(work: Path, entries: int, phashes: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(work / "optout.txt", "w") as f:
        for i in range(entries):
            kind = i % 10
            if kind < 5:
                f.write(_domain(i) + "\n")
            elif kind < 9:
                f.write(f"https://cdn{i % 1000}.net/img/{i}.jpg\n")
            else:
                f.write(f"https://host{i % 1000}.org/{'p' * (i % 60)}/{i}/*\n")
    with open(work / "sha256.txt", "w") as f:
        for chunk in range(0, entries, 1_000_000):
            rows = rng.integers(0, 256, (min(1_000_000, entries - chunk), 32), dtype=np.uint8)
            f.write("\n".join(r.tobytes().hex() for r in rows) + "\n")
    hashes = rng.integers(0, 2**63, phashes, dtype=np.uint64)
    np.save(work / "phash.npy", hashes)
    (work / "phash.txt").write_text("\n".join(f"{int(h):016x}" for h in hashes) + "\n")


def _child(work: str, kind: str) -> None:
    from pairforge.config import BlockListConfig
    from pairforge.download.lists import BlockList, OptOutList

    folder = Path(work)
    before = rss_mib()
    started = time.perf_counter()
    if kind == "optout":
        lists = OptOutList.load([str(folder / "optout.txt")], {})
        loaded = time.perf_counter() - started
        hits = [_domain(i) for i in range(0, 10 * (LOOKUPS // 2), 10)]  # i % 10 == 0: listed
        urls = [f"https://{h}/a.jpg" for h in hits]
        urls += [f"https://unlisted{i}.com/x/{i}.jpg" for i in range(LOOKUPS - len(urls))]
        started = time.perf_counter()
        found = sum(lists.matches(u) for u in urls)
        nbytes = lists.nbytes
        extra = {"prefix_lengths": len(lists.prefix_lengths)}
    else:
        lists = BlockList.load([BlockListConfig(path=str(folder / "sha256.txt"), kind="sha256"),
                                BlockListConfig(path=str(folder / "phash.txt"), kind="phash",
                                                max_distance=4)], {})
        loaded = time.perf_counter() - started
        rng = np.random.default_rng(1)
        listed = np.load(folder / "phash.npy")
        queries = [(rng.integers(0, 256, 32, dtype=np.uint8).tobytes().hex(), "0" * 32,
                    int(listed[i % len(listed)] ^ np.uint64(0b1010)) if i % 2 else int(
                        rng.integers(0, 2**63, dtype=np.uint64)))
                   for i in range(LOOKUPS)]
        started = time.perf_counter()
        found = sum(lists.match(*q) is not None for q in queries)
        nbytes = sum(s.nbytes for s in lists.exact.values()) + sum(
            s.nbytes for s in lists.phashes)
        extra = {}
    per_row_us = (time.perf_counter() - started) / LOOKUPS * 1e6
    print(json.dumps({"entries": len(lists), "load_s": round(loaded, 1),
                      "arrays_mib": round(nbytes / 2**20, 1),
                      "peak_rss_over_start_mib": round(peak_rss_mib() - before, 1),
                      "lookup_us_per_row": round(per_row_us, 2), "matched": found,
                      "lookups": LOOKUPS, **extra}))


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--entries", type=int, default=10_000_000)
    parser.add_argument("--phash", type=int, default=1_000_000)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lists-", dir=args.work))
    try:
        started = time.perf_counter()
        write_lists(work, args.entries, args.phash)
        print(f"wrote the lists in {time.perf_counter() - started:.0f} s", flush=True)
        for kind in ("optout", "block"):
            found = json_from_child([__file__, "--child", str(work), kind], f"the {kind} list")
            print(kind, json.dumps(found), flush=True)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(*sys.argv[2:4])
    else:
        main()
