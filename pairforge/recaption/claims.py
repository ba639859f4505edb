"""Within-build deduplication of captioning: one Ray actor that hands out claims by image.

The first row of an image (pixel hash) to reach any recaption actor claims it and runs the
model; rows of the same image reaching other actors meanwhile wait for the claimant's
caption instead of generating their own. An actor always generates its own claims before
it waits on others', so waits always end; a wait that times out (the claimant died)
generates locally, which costs model time but never loses a row.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

REGISTRY_PREFIX = "pairforge-recaption-claims-"


class ClaimRegistry:
    """An async Ray actor: claim, publish and wait by pixel hash."""

    def __init__(self) -> None:
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


def start_registry(name: str) -> Any:
    """Create the named registry next to the driver (it outlives any worker node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return ray.remote(ClaimRegistry).options(
        name=name, get_if_exists=True, num_cpus=0, max_concurrency=1000,
        scheduling_strategy=node).remote()


def find_registry(name: str) -> Any | None:
    import ray

    try:
        return ray.get_actor(name)
    except ValueError:
        return None
