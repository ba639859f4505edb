"""Shared fixtures: real images on disk and loopback HTTP servers (see loopback_server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from loopback_server import LoopbackServer, make_images


@pytest.fixture(scope="session")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of small real images: red.jpg, blue.png, green.webp."""
    directory = tmp_path_factory.mktemp("images")
    make_images(directory)
    return directory


@pytest.fixture
def http_server(image_dir: Path) -> Iterator[LoopbackServer]:
    """A keep-alive test server on 127.0.0.1 (the address tests allow-list)."""
    with LoopbackServer(image_dir, "127.0.0.1") as server:
        yield server


@pytest.fixture
def refused_server(image_dir: Path) -> Iterator[LoopbackServer]:
    """A server on 127.0.0.2, outside the allow-list: it must never receive a request."""
    with LoopbackServer(image_dir, "127.0.0.2") as server:
        yield server


COCO_IMAGES = Path(__file__).resolve().parents[2] / "shared" / "data" / "coco-sample" / "images"
COCO_CAPTIONS = COCO_IMAGES.parent / "captions.csv"


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """One local Ray instance for the in-process stage tests (starting Ray costs seconds)."""
    import ray

    from pairforge.config import RayConfig
    from pairforge.pipeline.ray_runtime import init_ray

    init_ray(RayConfig(num_cpus=2, object_store_memory=300 * 1024**2))
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def coco_server() -> Iterator[LoopbackServer]:
    """The COCO sample photos on 127.0.0.1, for the whole session."""
    with LoopbackServer(COCO_IMAGES, "127.0.0.1") as server:
        yield server
