"""The generic ways stages run Ray work, knowing no stage: bounded tasks, waves, Ray Data.

- ``run_bounded``: at most ``limit`` tasks in flight over a list of items, each result
  handed over as it finishes (stage 1's shard tasks, its splitting pass,
  ``download --retry-failed``);
- ``Waves``: waves of tasks whose small results come back in call order or folded as they
  arrive (stage 2 and the semantic pass, over partitioned files);
- Ray Data (stage 3): ``data_items`` starts a dataset, ``data_tasks`` appends a function
  run in plain tasks, ``data_pool`` a class run in a fixed pool of actors.

What runs where is the callers': stage 3's ``pipeline/placement.py`` says which step runs
in which pool with which resources, ``pipeline/stream.py`` reads and writes around them.
No domain package imports this module (tests/test_architecture.py); what each stage asks
Ray for is its contract's (pipeline/contract.py).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pairforge.config import ConfigError

T = TypeVar("T")


@contextmanager
def task_errors_raised() -> Iterator[None]:
    """A task's ConfigError (an input file that cannot be read) reaches the user as its
    own message naming the file, not inside Ray's traceback of the task."""
    from ray.exceptions import RayTaskError

    try:
        yield
    except RayTaskError as err:
        if isinstance(err.cause, ConfigError):
            raise err.cause from None
        raise


def slots_per_task(limit: int, queued: int, running: int) -> int:
    """Task slots each running task may use: one while tasks wait for a slot; once none
    waits (the run's tail), the slots of finished tasks spread over those still running."""
    return 1 if queued or not running else max(1, limit // running)


def run_bounded(items: list, submit, limit: int, on_tick, on_result=None,  # noqa: ANN001
                on_slots=None) -> None:  # noqa: ANN001
    """Keep at most ``limit`` tasks in flight (bounded memory), ticking the display with
    the tasks finished; ``on_result`` gets each task's result as it finishes, and
    ``on_slots`` each new ``slots_per_task`` while tasks run."""
    import ray

    queue, in_flight, finished, slots = list(items), [], 0, 1
    try:
        while queue or in_flight:
            while queue and len(in_flight) < limit:
                in_flight.append(submit(queue.pop(0)))
            # the first task to finish frees its slot at once, not at the next tick
            ready, in_flight = ray.wait(in_flight, num_returns=1, timeout=0.5,
                                        fetch_local=False)
            for ref in ready:
                result = ray.get(ref)  # re-raises a task's error in the driver
                if on_result:
                    on_result(result)
                finished += 1
            on_tick(finished)
            now = slots_per_task(limit, len(queue), len(in_flight))
            if on_slots and in_flight and now != slots:
                on_slots(now)
            slots = now
    except BaseException:
        # The stage stops: its other tasks stop too, rather than write on behind a rerun
        # started in the same process (a shard they leave is incomplete, so redone).
        for ref in in_flight:
            ray.cancel(ref)
        raise


class Waves:
    """Runs waves of Ray tasks; only their small results come back to the driver."""

    def __init__(self, retries: int, task_cpus: float = 1):
        """``task_cpus``: what a task asks for unless a wave says otherwise (a stage passes
        its contract's)."""
        self.retries, self.task_cpus = retries, task_cpus
        self.remotes: dict[str, Any] = {}
        self.seconds: Counter[str] = Counter()  # per phase, for the stats

    def _remote(self, fn: Callable[..., Any], cpus: float | None,
                name: str | None) -> tuple[Any, str]:
        import ray

        name = name or fn.__name__
        if name not in self.remotes:
            cpus = self.task_cpus if cpus is None else cpus
            self.remotes[name] = ray.remote(num_cpus=cpus, max_retries=self.retries)(
                fn).options(name=name)
        return self.remotes[name], name

    def run(self, fn: Callable[..., Any], calls: list[tuple], cpus: float | None = None,
            name: str | None = None) -> list[Any]:
        """One wave: ``fn(*args)`` for each of ``calls``, results in call order."""
        import ray

        remote, name = self._remote(fn, cpus, name)
        started = time.perf_counter()
        results = ray.get([remote.remote(*args) for args in calls])
        self.seconds[name] += time.perf_counter() - started
        return results

    def fold(self, fn: Callable[..., Any], calls: list[tuple], combine: Callable[[T, Any], T],
             total: T, cpus: float | None = None, name: str | None = None) -> T:
        """One wave whose results are combined as they arrive, so the driver holds one
        result at a time, not one per task."""
        import ray

        remote, name = self._remote(fn, cpus, name)
        started = time.perf_counter()
        pending = [remote.remote(*args) for args in calls]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            total = combine(total, ray.get(done[0]))
        self.seconds[name] += time.perf_counter() - started
        return total


def cluster_cpus() -> int:
    """The cluster's CPUs, at least one."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


# -- Ray Data ---------------------------------------------------------------------------

def data_items(items: list[dict[str, Any]]) -> Any:
    """A dataset of ``items``, one block each (each a task of the operators after it)."""
    import ray

    return ray.data.from_items(items, override_num_blocks=len(items))


def data_tasks(ds: Any, fn: Callable[..., Any], num_cpus: float, *, batch_size: int | None = None,
               fn_args: tuple = (), fn_kwargs: dict[str, Any] | None = None) -> Any:
    """``fn`` over pyarrow batches (whole blocks by default) in plain tasks asking
    ``num_cpus``: Ray's default of one CPU would wait behind actor pools holding them."""
    return ds.map_batches(fn, batch_size=batch_size, batch_format="pyarrow", num_cpus=num_cpus,
                          fn_args=fn_args, fn_kwargs=fn_kwargs or {})


def data_pool(ds: Any, cls: type, *, size: int, batch_size: int, num_cpus: float,
              concurrent: int = 1, constructor_args: tuple = (),
              fn_kwargs: dict[str, Any] | None = None, **ray_args: Any) -> Any:
    """``cls`` over pyarrow batches in a fixed pool of ``size`` actors, each constructed
    once; with ``concurrent`` above 1 each actor runs that many calls at once in threads
    (Ray Data serialises an actor's calls unless told otherwise, and queues at most twice
    its concurrency of tasks on it), each call one block of batches. ``ray_args``:
    ``num_gpus``, ``resources``."""
    from ray.data import ActorPoolStrategy

    compute = (ActorPoolStrategy(size=size) if concurrent <= 1 else
               ActorPoolStrategy(size=size, max_concurrent_calls_per_actor=concurrent,
                                 enable_true_multi_threading=True))
    return ds.map_batches(cls, fn_constructor_args=constructor_args, batch_size=batch_size,
                          batch_format="pyarrow", fn_kwargs=fn_kwargs or {}, compute=compute,
                          num_cpus=num_cpus, **ray_args)
