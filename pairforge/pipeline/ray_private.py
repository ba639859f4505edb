"""Every use of a private Ray API in pairforge, in one place.

Each use is named, says what it buys (measured: bench/RESULTS.md, "Private Ray APIs";
docs/ARCHITECTURE.md lists them) and falls back to Ray's normal behaviour when the installed
Ray no longer has what it relies on: ``problem(use)`` says what no longer applies, and
tests/test_ray_private.py fails on each, by name, when the pinned Ray changes. A use can be
switched off for a run (a Ray upgrade that breaks one, or a measurement):
``PAIRFORGE_RAY_PRIVATE_OFF=dashboard,node_poll`` (``all`` for every one).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

OFF_ENV = "PAIRFORGE_RAY_PRIVATE_OFF"
USES = ("monitors", "dashboard", "node_poll", "loopback", "replica_grpc", "soft_limit",
        "prestart", "cut_blocks")


def switched_off(use: str) -> bool:
    """Whether ``PAIRFORGE_RAY_PRIVATE_OFF`` names ``use`` (or says ``all``)."""
    names = {n.strip() for n in os.environ.get(OFF_ENV, "").split(",")}
    return use in names or "all" in names


def _has_parameters(function: Any, *names: str) -> bool:
    try:
        return set(names) <= set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False


# --- a local instance without three of Ray's Python processes -------------------------
# The log monitor tails every worker's log files to forward them to the driver, which
# ``log_to_driver=False`` never shows; the autoscaler monitor autoscales a cluster of one
# fixed node; the dashboard (started even with ``include_dashboard=False``, then with only
# its usage-stats module, which ``RAY_USAGE_STATS_ENABLED=0`` idles) serves a web UI and
# the state and job APIs that a local run never uses, and ``ray.init`` waits for it to
# publish its address. ``ray start`` has flags for the monitors (--include-log-monitor,
# --no-monitor), ``ray.init`` none for any of the three.


def _monitors_problem() -> str | None:
    try:
        from ray._private.parameter import RayParams
    except ImportError as error:
        return f"ray._private.parameter.RayParams: {error}"
    if not _has_parameters(RayParams.__init__, "include_log_monitor", "no_monitor"):
        return "RayParams.__init__ takes no include_log_monitor and no_monitor"
    return None


def _dashboard_problem() -> str | None:
    try:
        from ray._private.node import Node
    except ImportError as error:
        return f"ray._private.node.Node: {error}"
    method = getattr(Node, "start_api_server", None)
    if method is None or not _has_parameters(method, "include_dashboard", "raise_on_failure"):
        return "Node.start_api_server(*, include_dashboard, raise_on_failure) is gone"
    return None


def _node_poll_problem() -> str | None:
    try:
        from ray._private import services
        from ray._raylet import GcsClient, InnerGcsClient  # noqa: F401 (GcsClient wraps it)
        from ray.core.generated.gcs_pb2 import GcsNodeInfo
        from ray.core.generated.gcs_service_pb2 import GetAllNodeInfoRequest
    except ImportError as error:
        return f"an import: {error}"
    if not _has_parameters(services.get_node, "gcs_address", "node_id"):
        return "ray._private.services.get_node(gcs_address, node_id) is gone"
    if not _has_parameters(getattr(InnerGcsClient, "get_all_node_info", None), "timeout",
                           "node_selectors", "state_filter"):
        return "GcsClient.get_all_node_info(timeout, node_selectors, state_filter) changed"
    if not hasattr(GcsNodeInfo, "ALIVE") or not hasattr(GetAllNodeInfoRequest, "NodeSelector"):
        return "GcsNodeInfo.ALIVE or GetAllNodeInfoRequest.NodeSelector is gone"
    return None


@contextmanager
def lean_local_start() -> Iterator[None]:
    """While a local instance starts: no log monitor and no autoscaler monitor
    (``monitors``), no dashboard (``dashboard``), the driver finds its node as soon as
    the raylet registers (``node_poll``), and every server of the instance listens on
    loopback only (``loopback``). Each use that is switched off or no longer applies
    leaves Ray's own start as it is."""
    applied: list[tuple[Any, str, Any]] = []  # (owner, attribute, Ray's original)
    try:
        if applies("loopback"):
            applied.append(_loopback_node())
        if applies("monitors"):
            from ray._private.parameter import RayParams
            applied.append((RayParams, "__init__", RayParams.__init__))
            RayParams.__init__ = _without_monitors(RayParams.__init__)
        if applies("dashboard"):
            from ray._private.node import Node
            applied.append((Node, "start_api_server", Node.start_api_server))
            Node.start_api_server = _no_api_server
        if applies("node_poll"):
            from ray._private import services
            applied.append((services, "get_node", services.get_node))
            services.get_node = _after_registration(services.get_node)
        yield
    finally:
        for owner, attribute, original in reversed(applied):
            setattr(owner, attribute, original)


def _without_monitors(init: Callable[..., None]) -> Callable[..., None]:
    def quiet(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.include_log_monitor = False
        self.no_monitor = True

    return quiet


def _no_api_server(self: Any, **_: Any) -> None:
    self._webui_url = None  # what Ray records when the dashboard cannot start


def _after_registration(get_node: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
    """Ray's ``get_node`` once the node is in the GCS.

    ``ray.init`` asks for its new node 0.1 s after starting the raylet, which registers
    ~0.5 s after its start; a miss makes Ray's lookup sleep a whole second before asking
    again. Polling every 20 ms first gives the driver its node sooner. It also waits
    longer than Ray would: Ray's own loop gives up after a fixed 30 s ("The current node
    timed out during startup"), which a local start on a busy machine misses (seen at
    load averages of 30 and more); here a start gets ``REGISTRATION_PATIENCE_S`` first.
    """
    def after(gcs_address: str, node_id: str) -> Any:
        wait_for_registration(gcs_address, node_id)
        return get_node(gcs_address, node_id)

    return after


REGISTRATION_PATIENCE_S = 120.0


def wait_for_registration(gcs_address: str, node_id: str,
                          patience_s: float = REGISTRATION_PATIENCE_S) -> bool:
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


# --- a local instance on loopback only (``loopback``, ``replica_grpc``) -----------------
# Ray binds its servers by the node's IP address. With a loopback one (127.0.0.1) the GCS,
# the raylet's node and object managers, every worker's core-worker server and the
# dashboard agent's gRPC server (dashboard/agent.py: localhost if ``is_localhost``, else
# ``get_all_interfaces_ip``) listen on loopback, and so do the agents' HTTP servers (on the
# node's address); with the host's address the first five listen on every interface ("*",
# IPv4 and IPv6) and the others on that address. A local instance is never joined from
# another host, so its node's address is loopback: Ray's own choice where clusters are off
# (macOS and Windows, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``), which
# ``services.get_node_ip_address`` reads from ``ray_constants.ENABLE_RAY_CLUSTER``.
# ``ray.init(_node_ip_address="127.0.0.1")`` does not do it: Ray replaces a loopback
# address by that same function's answer (``services.resolve_ip_for_localhost``), and the
# variable is read once, when Ray is imported, before ``init_ray`` can set it.
#
# One server takes no address from the node: each Serve replica's inter-deployment gRPC
# server binds "[::]:0" (``Replica._on_initialized``); callers reach it at the replica's
# node address, so on a loopback node it binds that address instead (``replica_grpc``).


def _loopback_node() -> tuple[Any, str, Any]:
    """Make this process's node address loopback; returns what to restore."""
    from ray._private import ray_constants

    original = (ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    ray_constants.ENABLE_RAY_CLUSTER = False
    return original


def is_loopback_address(address: str) -> bool:
    """Whether a Ray address (``host:port``, or ``auto``) names this host's loopback
    interface: the address a local instance started by pairforge publishes."""
    from ray._common.network_utils import is_localhost, parse_address

    if address == "auto":  # the instance this host started last, as Ray finds it
        from ray._private import services

        find = getattr(services, "find_bootstrap_address", None)
        address = (find(None) if find else None) or ""
    parsed = parse_address(address) if "://" not in address else None
    return bool(parsed) and is_localhost(parsed[0])


@contextmanager
def joining(address: str) -> Iterator[None]:
    """While a driver joins the Ray at ``address``: if that is a loopback-only instance
    (``loopback``: e.g. one that ``pairforge serve`` or another pairforge process started),
    the driver's node address is loopback too. Otherwise Ray turns 127.0.0.1 into the
    host's own address, looks for the instance's raylet there, and waits forever. Any
    other address (a cluster's head) is joined as Ray joins it."""
    if not (applies("loopback") and is_loopback_address(address)):
        yield
        return
    owner, attribute, original = _loopback_node()
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def _loopback_problem() -> str | None:
    try:
        from ray._private import ray_constants, services
    except ImportError as error:
        return f"ray._private.services: {error}"
    if not isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTER", None), bool):
        return "ray_constants.ENABLE_RAY_CLUSTER is gone"
    try:
        source = inspect.getsource(services.get_node_ip_address)
    except (OSError, TypeError):
        return "services.get_node_ip_address has no source to read"
    if "ENABLE_RAY_CLUSTER" not in source or "get_localhost_ip" not in source:
        return "services.get_node_ip_address no longer answers loopback without clusters"
    return None


_REPLICA_ADDRESS = '"[::]:0"'  # what Replica._on_initialized binds


def _replica_grpc_problem() -> str | None:
    try:
        from ray.serve._private import replica
    except ImportError as error:
        return f"ray.serve._private.replica: {error}"
    starts = getattr(getattr(replica, "Replica", None), "_on_initialized", None)
    try:
        source = inspect.getsource(starts) if starts else ""
    except (OSError, TypeError):
        source = ""
    if f"add_port_to_grpc_server(self._server, {_REPLICA_ADDRESS})" not in source:
        return ("Replica._on_initialized no longer binds its gRPC server with "
                f"add_port_to_grpc_server(self._server, {_REPLICA_ADDRESS})")
    if not callable(getattr(replica, "add_port_to_grpc_server", None)):
        return "ray.serve._private.replica.add_port_to_grpc_server is gone"
    return None


def bind_replica_grpc_to_node() -> None:
    """In a Serve replica's process (called from a deployment's constructor, which Ray
    runs before the replica starts that server): on a loopback node, its inter-deployment
    gRPC server binds the node's address, not every interface. Elsewhere, switched off or
    no longer applying: Ray's own binding."""
    import ray
    from ray._common.network_utils import build_address, is_localhost

    node = ray.util.get_node_ip_address()
    if not applies("replica_grpc") or not is_localhost(node):
        return
    from ray.serve._private import replica

    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "pairforge_node", None):
        return

    def on_node(server: Any, address: str) -> int:
        if address == _REPLICA_ADDRESS.strip('"'):
            address = build_address(node, 0)
        return add_port(server, address)

    on_node.pairforge_node = node  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_node


# --- Ray's internal worker settings (``soft_limit``, ``prestart``) ----------------------
# Set as ``RAY_<name>`` in the environment the raylet inherits, rather than through
# ``ray.init(_system_config=...)``: Ray reads the variable of each setting it knows and
# ignores any other, where an unknown ``_system_config`` key makes the GCS exit and
# ``ray.init`` fail after 30 s. So a renamed setting leaves Ray's default in place.


def worker_settings(cpus: int) -> dict[str, str]:
    """``RAY_<name>`` variables of a local instance with ``cpus`` CPUs.

    ``soft_limit``: Ray kills idle workers beyond one per CPU after a second, and actors
    count: while model pools hold the CPUs, each reading or writing task of stage 3 would
    start a fresh worker process (~1 s of CPU). Twice the CPUs keeps the task workers.

    ``prestart``: Ray starts one worker per CPU as the driver connects, before any task
    asks, at most one per CPU at a time: the first tasks and the progress actor then wait
    for a third worker started once those are up. Started on demand instead, the first
    shard begins sooner with one process less."""
    settings = {}
    if not switched_off("soft_limit"):
        settings["RAY_num_workers_soft_limit"] = str(2 * cpus + 2)
    if not switched_off("prestart"):
        settings["RAY_prestart_worker_first_driver"] = "0"
    return settings


@contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` set while Ray starts its processes (which inherit them), then
    removed; a value the user set is left as it is."""
    added = [name for name in variables if name not in os.environ]
    os.environ.update({name: variables[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


# --- a repartition that the actor pools cannot starve (``cut_blocks``) ------------------


def _cut_op(ds: Any) -> Any:
    """The dataset's last logical operator, if it is a repartition that takes remote
    arguments; else None."""
    op = getattr(getattr(ds, "_logical_plan", None), "dag", None)
    if type(op).__name__ != "StreamingRepartition":
        return None
    return op if isinstance(getattr(op, "ray_remote_args", None), dict) else None


def _cut_blocks_problem() -> str | None:
    try:
        from ray.data._internal.logical.operators import StreamingRepartition
    except ImportError as error:
        return f"ray.data's StreamingRepartition: {error}"
    try:
        fields = {field.name for field in dataclasses.fields(StreamingRepartition)}
    except TypeError:  # no longer a dataclass
        fields = set()
    if "ray_remote_args" not in fields:
        return "StreamingRepartition has no ray_remote_args field"
    return None


def cut_into_blocks(ds: Any, rows: int, num_cpus: float) -> Any:
    """``ds`` in blocks of at most ``rows`` rows, the cutting task asking ``num_cpus``.

    Ray Data's ``repartition`` takes no resource arguments and asks one CPU per task,
    which the actor pools may all hold: the stage would hang. At the plain tasks' fraction
    Ray fuses the cut into the task before it. Without that attribute (or switched off),
    the blocks stay whole: one shard then goes to one actor of a pool, slower, never stuck.
    """
    if not applies("cut_blocks"):
        return ds
    cut = ds.repartition(target_num_rows_per_block=rows)
    op = _cut_op(cut)
    if op is None:
        return ds
    op.ray_remote_args["num_cpus"] = num_cpus
    return cut


_CHECKS: dict[str, Callable[[], str | None]] = {
    "monitors": _monitors_problem,
    "dashboard": _dashboard_problem,
    "node_poll": _node_poll_problem,
    "loopback": _loopback_problem,
    "replica_grpc": _replica_grpc_problem,
    "cut_blocks": _cut_blocks_problem,
}


def problem(use: str) -> str | None:
    """What the installed Ray lacks or has changed of what ``use`` relies on, or None.
    ``soft_limit`` and ``prestart`` have no attribute to check (Ray ignores a variable it
    does not know): tests/test_ray_private.py checks their effect."""
    check = _CHECKS.get(use)
    return check() if check else None


def applies(use: str) -> bool:
    """Whether ``use`` is on and the installed Ray still has what it relies on."""
    return not switched_off(use) and problem(use) is None
