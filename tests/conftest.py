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
