"""The run's host coordinators as named Ray actors, and a shard task's link to them.

A stage-1 run has ``coordinator_count`` coordinators, named ``pairforge-hosts-<run id>-<k>``
in the ``pairforge-hosts`` namespace, so two runs never share one. The first shard task
of the run that asks makes them (``get_if_exists``: the others find them), as many as the
cluster's CPUs call for then, each made with that count. A task asks the first of them
that answers how many there are, so every task hashes a host to the same one; one made
again (lost for good mid-run) is made with the run's count, never the cluster's of that
moment. Each is a zero-CPU, single-threaded actor holding a ``HostBook`` and a
``FileStore`` (``download/host_coordinator.py``): per-host state for hosts with live
leases only, and a byte-bounded cache of the origins' robots.txt and tdmrep.json.

They live on Ray's head node (``HEAD_RESOURCE``), as the progress counter lives beside
the driver, so a worker node lost mid-run takes none of them: its shard tasks are retried
by Ray and take leases like any other. They are detached (a task's worker, their maker,
may end before the run) and restarted by Ray when they die (``max_restarts=-1``: a killed
actor); a restarted one starts empty and the tasks take leases again, while the per-task
rule covers the gap (``download/host_leases.py``). The stage's driver removes them when
the run ends (:func:`end_run`, through ``consent.remove_cache``); one that no call
reached for ``IDLE_EXIT_S`` ends itself (a driver that died, a task run outside the
stage).

``PAIRFORGE_HOST_COORDINATORS=off`` in the workers' environment makes every task follow
the per-task rule (bench/politeness.py's "before" figures; an escape hatch, never needed
for correctness). Ray stays here: the rest of ``download/`` sees only the
``CoordinatorLink`` protocol.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from pairforge.config import DownloadConfig
from pairforge.download.host_coordinator import FileStore, HostBook, Limits
from pairforge.download.host_leases import CALL_TIMEOUT_S, Grant

log = logging.getLogger(__name__)

NAMESPACE = "pairforge-hosts"
SWITCH = "PAIRFORGE_HOST_COORDINATORS"  # "off" in the workers' environment: per-task rule
IDLE_EXIT_S = 120.0
MAKE_TIMEOUT_S = 60.0  # the first call waits for the actor's process to start
# a lease call that takes longer marks its coordinator lost: a dead one must not hold up
# the renewals of the others (one thread renews a task's leases with all of them)
EXCHANGE_TIMEOUT_S = 1.0
CPUS_PER_COORDINATOR = 64  # one coordinator per this many cluster CPUs, 1 to 8
MAX_COORDINATORS = 8
# the resource only Ray's head node has: Ray places a zero-CPU actor on a node it draws
# at random; on the head, whose loss ends the cluster anyway, no worker node lost mid-run
# takes a coordinator with it
HEAD_RESOURCE = "node:__internal_head__"


class HostCoordinator:
    """One coordinator's state behind Ray calls (one at a time: ``max_concurrency`` 1)."""

    def __init__(self, limits: Limits, shards: int) -> None:
        self.book = HostBook(limits)
        self.files = FileStore()
        self.shards = shards
        self.last_call = time.monotonic()
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def shard_count(self) -> int:
        self.last_call = time.monotonic()
        return self.shards

    def exchange(self, task: str, asks: list[dict[str, Any]]) -> list[Grant]:
        self.last_call = time.monotonic()
        return self.book.exchange(task, asks)

    def get_file(self, key: str, ttl: float, claimant: str | None = None
                 ) -> tuple[str, dict[str, Any] | None]:
        self.last_call = time.monotonic()
        return self.files.get(key, ttl, claimant)

    def put_file(self, key: str, entry: dict[str, Any]) -> None:
        self.last_call = time.monotonic()
        self.files.put(key, entry)

    def held(self) -> dict[str, int]:
        """What it holds: hosts, and files with their bytes (bounded, for tests)."""
        return {"hosts": len(self.book.hosts), "file_bytes": self.files.bytes}

    def _exit_when_idle(self) -> None:
        import ray

        while time.monotonic() - self.last_call < IDLE_EXIT_S:
            time.sleep(min(10.0, IDLE_EXIT_S / 4))
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def coordinator_count() -> int:
    """How many coordinators a run gets, from the cluster's CPUs when the run's first task
    asks (a task's leases take about one call per coordinator per second)."""
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    return max(1, min(MAX_COORDINATORS, cpus // CPUS_PER_COORDINATOR + 1))


def coordinator_name(run_id: str, shard: int) -> str:
    return f"pairforge-hosts-{run_id}-{shard}"


class RayLink:
    """A task's ``CoordinatorLink`` to the run's coordinators."""

    def __init__(self, run_id: str, limits: Limits) -> None:
        self.run_id = run_id
        self.limits = limits
        self._handles: dict[int, Any] = {}
        self.shards = self._run_count()
        self._warm_up()

    def _run_count(self) -> int:
        """The run's coordinator count, which every task must hash hosts by: asked of the
        run's coordinators that exist, each made with it (and a restarted one made again
        with it); only the run's first task, which finds none, counts the cluster's CPUs
        (:func:`coordinator_count`) and makes coordinator 0 with that. Asking coordinator
        0 alone made it again, once lost for good, with the cluster's count of that
        moment (a node lost or added changes it), and a task then hashed hosts by
        another count than the run's other tasks."""
        import ray

        refs = []
        for shard in range(MAX_COORDINATORS):
            try:
                handle = ray.get_actor(coordinator_name(self.run_id, shard),
                                       namespace=NAMESPACE)
            except ValueError:
                continue  # not made, or lost for good
            refs.append(handle.shard_count.remote())
        deadline = time.monotonic() + MAKE_TIMEOUT_S
        while refs:  # the first that answers (a restarting one answers once it is back)
            ready, refs = ray.wait(refs, num_returns=1,
                                   timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                return int(ray.get(ready[0]))
            except Exception:  # noqa: BLE001, S112 - died meanwhile: ask the next
                continue
        return ray.get(self._handle(0, coordinator_count()).shard_count.remote(),
                       timeout=MAKE_TIMEOUT_S)

    def _warm_up(self) -> None:
        """All the coordinators up before the first lease, so that a lease's call never
        waits for an actor's process to start (its short timeout means a lost
        coordinator). One that does not answer (restarting, or lost as the task starts)
        is for the task's leases to find lost and take back when it answers
        (``HostLeases``): the task does not give up the run-wide rule for all its hosts."""
        import ray

        refs = {}
        for shard in range(self.shards):
            try:
                refs[shard] = self._handle(shard).shard_count.remote()
            except Exception as err:  # noqa: BLE001 - its leases will say it is lost
                log.warning("host coordinator %d of run %s not made (%s)", shard,
                            self.run_id, err)
                self._forget(shard)
        deadline = time.monotonic() + MAKE_TIMEOUT_S
        for shard, ref in refs.items():
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as err:  # noqa: BLE001 - its leases will say it is lost
                log.warning("host coordinator %d of run %s did not answer at the task's "
                            "start (%s)", shard, self.run_id, err)
                self._forget(shard)

    def _handle(self, shard: int, count: int | None = None) -> Any:
        """Coordinator ``shard``, made with the run's count where it is not running
        (``count``: before the task knows the run's count)."""
        import ray

        handle = self._handles.get(shard)
        if handle is None:
            handle = ray.remote(HostCoordinator).options(
                name=coordinator_name(self.run_id, shard), namespace=NAMESPACE,
                lifetime="detached", get_if_exists=True, num_cpus=0,
                resources={HEAD_RESOURCE: 0.001}, max_restarts=-1,
                max_concurrency=1).remote(self.limits, count or self.shards)
            self._handles[shard] = handle
        return handle

    def _forget(self, shard: int) -> None:
        """After a failed call: look the actor up (or make it) again next time; a
        restarted actor keeps its handle, one killed for good needs a new one."""
        self._handles.pop(shard, None)

    def exchange_all(self, task: str, asks: dict[int, list[dict[str, Any]]]
                     ) -> dict[int, list[Grant] | BaseException]:
        import ray

        refs: dict[int, Any] = {}
        results: dict[int, list[Grant] | BaseException] = {}
        for shard, batch in asks.items():
            try:
                refs[shard] = self._handle(shard).exchange.remote(task, batch)
            except Exception as err:  # noqa: BLE001 - not even made: the coordinator is lost
                self._forget(shard)
                results[shard] = err
        deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
        for shard, ref in refs.items():
            try:
                results[shard] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as err:  # noqa: BLE001 - dead, restarting or too slow
                self._forget(shard)
                results[shard] = err
        return results

    def get_file(self, shard: int, key: str, ttl: float, claimant: str | None = None
                 ) -> tuple[str, dict[str, Any] | None]:
        import ray

        try:
            return ray.get(self._handle(shard).get_file.remote(key, ttl, claimant),
                           timeout=CALL_TIMEOUT_S)
        except Exception:
            self._forget(shard)
            raise

    def put_file(self, shard: int, key: str, entry: dict[str, Any]) -> None:
        import ray

        try:
            ray.get(self._handle(shard).put_file.remote(key, entry), timeout=CALL_TIMEOUT_S)
        except Exception:
            self._forget(shard)
            raise


def end_run(run_id: str) -> int:
    """Remove run ``run_id``'s coordinators (the stage's driver, once its tasks are done);
    how many there were. A no-op without Ray."""
    try:
        import ray
    except ImportError:
        return 0
    if not ray.is_initialized():
        return 0
    ended = 0
    for shard in range(MAX_COORDINATORS):
        try:
            handle = ray.get_actor(coordinator_name(run_id, shard), namespace=NAMESPACE)
        except ValueError:
            continue  # made only once a host of its share was asked for
        ray.kill(handle, no_restart=True)
        ended += 1
    return ended


def run_link(cfg: DownloadConfig, run_id: str | None) -> RayLink | None:
    """The link of a shard task running on Ray as part of run ``run_id``; None elsewhere
    (no run, not in a Ray worker) or when the coordinators cannot be reached at the start
    (the per-task rule then applies, as the log says)."""
    if run_id is None or os.environ.get(SWITCH, "").lower() in ("off", "0", "false"):
        return None
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized() or getattr(ray.get_runtime_context(), "worker",
                                           None) is None:
        return None
    if ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None  # the driver, or a test calling a task's function itself
    try:
        return RayLink(run_id, Limits.of(cfg))
    except Exception as err:  # noqa: BLE001 - politeness must not stop the run
        log.warning("host coordinators of run %s not reachable (%s): this task follows the "
                    "per-task rule (download.per_host_* for itself alone)", run_id, err)
        return None
