"""CPU time of ``shards.tar.read_samples`` over a training-like shard in memory.

2,000 samples of five members (a 20 kB jpg, txt, json and two small .npy), so 10,000
ustar headers: the walk stage 3's writer and ``shards.training`` pay per shard. Prints
the median and range of CPU milliseconds over ``--rounds`` reads.

    PYTHONPATH=$PWD python bench/tar_read.py --rounds 15
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

from pairforge.shards.tar import SampleTarWriter, read_samples


def shard(samples: int = 2000) -> bytes:
    buffer = io.BytesIO()
    with SampleTarWriter(buffer, mtime=1) as writer:
        for i in range(samples):
            writer.write(f"{i:09d}", {"jpg": b"x" * 20000, "txt": "a caption " * 5,
                                      "json": {"key": i}, "vq.npy": b"\x93" * 512,
                                      "tok.npy": b"t" * 200})
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    rounds = parser.parse_args().rounds
    archive = shard()
    seconds = []
    for _ in range(rounds):
        started = time.process_time()
        read = sum(1 for _ in read_samples(archive))
        seconds.append(time.process_time() - started)
    assert read == 2000
    print(f"read_samples, 10,000 members: median {statistics.median(seconds) * 1e3:.1f} ms CPU "
          f"(min {min(seconds) * 1e3:.1f}, max {max(seconds) * 1e3:.1f}, {rounds} rounds)")


if __name__ == "__main__":
    main()
