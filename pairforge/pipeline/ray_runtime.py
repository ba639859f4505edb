"""Starting or joining Ray: a quiet local instance by default, a cluster when asked."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pairforge.config import RayConfig

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


@contextmanager
def _lean_local_start() -> Iterator[None]:
    """A local instance without the log monitor, the autoscaler monitor and the dashboard,
    found by the driver as soon as its raylet registers.

    The log monitor tails every worker's log files to forward them to the driver, which
    ``log_to_driver=False`` never shows; the monitor autoscales a cluster of one fixed
    node; the dashboard (started even with ``include_dashboard=False``, then with only its
    usage-stats module, which ``RAY_USAGE_STATS_ENABLED=0`` idles) serves a web UI and the
    state and job APIs, none of which a local run uses, and ``ray.init`` waits for it to
    publish its address. Each is a Python process that imports Ray and then polls: 1.4,
    1.1 and 1.45 s of CPU per run, and the dashboard ~1 s of ``ray.init``'s wall time
    (bench/RESULTS.md, stage 1). ``ray start`` has flags for the first two
    (--include-log-monitor, --no-monitor), ``ray.init`` none for any, so they are set on
    the way in; a cluster (``address``) is joined as it is. A Ray without these
    attributes starts as it always does.
    """
    try:
        from ray._private import services
        from ray._private.node import Node
        from ray._private.parameter import RayParams
    except ImportError:
        yield
        return
    original_params, original_api_server = RayParams.__init__, Node.start_api_server
    original_get_node = services.get_node

    def quiet(self: Any, *args: Any, **kwargs: Any) -> None:
        original_params(self, *args, **kwargs)
        self.include_log_monitor = False
        self.no_monitor = True

    def no_api_server(self: Any, **_: Any) -> None:
        self._webui_url = None  # what Ray records when the dashboard cannot start

    RayParams.__init__, Node.start_api_server = quiet, no_api_server
    services.get_node = _after_registration(original_get_node)
    try:
        yield
    finally:
        RayParams.__init__, Node.start_api_server = original_params, original_api_server
        services.get_node = original_get_node


def _after_registration(get_node: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
    """Ray's ``get_node`` once the node is in the GCS.

    ``ray.init`` asks for its new node 0.1 s after starting the raylet, which registers
    ~0.5 s after its start; a miss makes Ray's lookup sleep a whole second before asking
    again. Polling every 20 ms first gives the driver its node ~0.6 s sooner per run.
    """
    def after(gcs_address: str, node_id: str) -> Any:
        _wait_for_registration(gcs_address, node_id)
        return get_node(gcs_address, node_id)

    return after


def _wait_for_registration(gcs_address: str, node_id: str, patience_s: float = 5.0) -> bool:
    """Whether the GCS lists ``node_id`` alive within ``patience_s`` (a slower start is
    left to Ray's own wait, which reports the failure)."""
    try:
        from ray._raylet import GcsClient
        from ray.core.generated.gcs_pb2 import GcsNodeInfo
        from ray.core.generated.gcs_service_pb2 import GetAllNodeInfoRequest

        client = GcsClient(address=gcs_address)
        selector = GetAllNodeInfoRequest.NodeSelector(node_id=bytes.fromhex(node_id))
        deadline = time.monotonic() + patience_s
        while time.monotonic() < deadline:
            if client.get_all_node_info(timeout=1, node_selectors=[selector],
                                        state_filter=GcsNodeInfo.ALIVE):
                return True
            time.sleep(0.02)
    except Exception:  # another Ray's internals: its own wait alone decides
        pass
    return False


def local_system_config(cfg: RayConfig) -> dict[str, Any]:
    """Ray settings of a local instance (a cluster sets them with ``RAY_<name>`` at
    ``ray start``). Ray kills idle workers beyond one per CPU after a second, and actors
    count: while model pools hold the CPUs, each reading or writing task of stage 3 would
    start a fresh worker process (~1 s of CPU). Twice the CPUs keeps the task workers.

    Ray also starts one worker per CPU as the driver connects, before any task asks, and
    at most one per CPU at a time: the stage's first tasks and its progress actor then
    wait for a third worker started only once those two are up, and a fourth nobody uses
    starts with it. Started on demand instead, the first shard begins ~0.3 s sooner with
    one process less (bench/RESULTS.md, "Ray's start, a third look")."""
    cpus = cfg.num_cpus or os.cpu_count() or 1
    return {"num_workers_soft_limit": 2 * cpus + 2, "prestart_worker_first_driver": False}


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
            with _lean_local_start():
                ray.init(num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_memory,
                         include_dashboard=False, _system_config=local_system_config(cfg),
                         **common)
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
