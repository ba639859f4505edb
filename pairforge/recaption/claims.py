"""Within-build deduplication of captioning: Ray actors that hand out claims by image.

The first row of an image (pixel hash) to reach any recaption actor claims it and runs the
model; rows of the same image reaching other actors meanwhile wait for the claimant's
caption instead of generating their own. An actor always generates its own claims before
it waits on others', so waits always end; a wait that times out (the claimant died)
generates locally, which costs model time but never loses a row.

The registry is one actor per ``ROWS_PER_PART`` rows of the run (``registry_parts``), each
holding the pixel hashes (and published captions) of one partition (``string_hash`` of the
pixel hash, ``dedup/shuffle.py``), named ``NAME-PP``: every hash has one actor, so a claim
is still one per image per build, and no actor holds more than its share of a build
however large. A small build (the demo, a test) has one actor, not a process per
partition it does not need (each ~130 MiB and a second of CPU to start).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pyarrow as pa

from pairforge.dedup.shuffle import part_of, string_hash

REGISTRY_PREFIX = "pairforge-recaption-claims-"
ROWS_PER_PART = 1 << 22  # ~0.5-1 GiB of hashes, keys and captions in one actor


def registry_parts(rows: int) -> int:
    """How many actors hold the claims of a run of ``rows`` rows."""
    return max(1, -(-rows // ROWS_PER_PART))


class ClaimRegistry:
    """An async Ray actor: claim, publish and wait by pixel hash (one partition's)."""

    def __init__(self, parts: int) -> None:
        self.parts = parts  # of the whole registry: how a finder knows its actors
        self.claims: dict[str, str] = {}
        self.captions: dict[str, Any] = {}
        self.events: dict[str, asyncio.Event] = {}

    async def claim(self, items: list[tuple[str, str]]) -> list[str]:
        """For each (pixel hash, key): the key that captions that image."""
        return [self.claims.setdefault(pixel_hash, key) for pixel_hash, key in items]

    async def publish(self, captions: dict[str, Any]) -> None:
        self.captions.update(captions)
        for pixel_hash in captions:
            self.events.setdefault(pixel_hash, asyncio.Event()).set()

    async def wait(self, hashes: list[str], timeout_s: float) -> dict[str, Any]:
        """The published captions of ``hashes`` that arrive within ``timeout_s``."""
        waits = [self.events.setdefault(h, asyncio.Event()).wait() for h in hashes]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
        return {h: self.captions[h] for h in hashes if h in self.captions}

    async def size(self) -> int:
        return self.parts


def registry_part(pixel_hashes: list[str], parts: int) -> np.ndarray:
    """The registry actor (partition) of each pixel hash: the same in every process."""
    return part_of(string_hash(pa.array(pixel_hashes, pa.string())), parts)


def part_name(name: str, part: int) -> str:
    return f"{name}-{part:02x}"


class PartitionedClaims:
    """The registry's actors as one: each call is split by partition, sent to every
    actor it concerns at once, and joined. A lost actor sets ``lost`` (the calls answer
    None): that only costs the within-build sharing."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.lost = False

    def _split(self, hashes: list[str]) -> dict[int, list[int]]:
        parts = registry_part(hashes, len(self.actors)) if hashes else np.zeros(0, np.int64)
        split: dict[int, list[int]] = {}
        for i, part in enumerate(parts.tolist()):
            split.setdefault(part, []).append(i)
        return split

    def _gather(self, calls: list[Any]) -> list[Any] | None:
        import ray

        try:
            return ray.get(calls)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            self.lost = True
            return None

    def claim(self, items: list[tuple[str, str]]) -> list[str] | None:
        split = self._split([h for h, _ in items])
        answers = self._gather([self.actors[p].claim.remote([items[i] for i in rows])
                                for p, rows in split.items()])
        if answers is None:
            return None
        keys = [""] * len(items)
        for rows, answer in zip(split.values(), answers, strict=True):
            for i, key in zip(rows, answer, strict=True):
                keys[i] = key
        return keys

    def publish(self, captions: dict[str, Any]) -> None:
        hashes = list(captions)
        self._gather([self.actors[p].publish.remote({hashes[i]: captions[hashes[i]]
                                                     for i in rows})
                      for p, rows in self._split(hashes).items()])

    def wait(self, hashes: list[str], timeout_s: float) -> dict[str, Any] | None:
        answers = self._gather([self.actors[p].wait.remote([hashes[i] for i in rows],
                                                          timeout_s)
                                for p, rows in self._split(hashes).items()])
        return None if answers is None else {h: c for a in answers for h, c in a.items()}


def start_registry(name: str, parts: int) -> list[Any]:
    """Create the registry's named actors next to the driver (they outlive any worker
    node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return [ray.remote(ClaimRegistry).options(
        name=part_name(name, part), get_if_exists=True, num_cpus=0, max_concurrency=1000,
        scheduling_strategy=node).remote(parts) for part in range(parts)]


def stop_registry(actors: list[Any]) -> None:
    import ray

    for actor in actors:
        ray.kill(actor)


def find_registry(name: str) -> PartitionedClaims | None:
    """The registry's actors, or None where it was not started (or lost one)."""
    import ray

    try:
        first = ray.get_actor(part_name(name, 0))
        parts = ray.get(first.size.remote(), timeout=30)
        return PartitionedClaims([first] + [ray.get_actor(part_name(name, p))
                                            for p in range(1, parts)])
    except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None
