"""The private Ray APIs of pipeline/ray_private.py: each still applies to the pinned Ray
and takes effect, and each falls back to Ray's own behaviour when it does not apply.

A failure here after a Ray upgrade names the use that broke; until it is fixed, a run can
switch it off with ``PAIRFORGE_RAY_PRIVATE_OFF=<use>``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pairforge.pipeline import ray_private
from pairforge.pipeline.ray_private import USES, problem, switched_off


def _skip_if_switched_off(use: str) -> None:
    if switched_off(use):
        pytest.skip(f"{use} is switched off by PAIRFORGE_RAY_PRIVATE_OFF")


@pytest.mark.parametrize("use", USES)
def test_the_pinned_ray_has_what_each_use_relies_on(use):
    assert problem(use) is None, f"private Ray API use {use!r} no longer applies: {problem(use)}"


def _command_lines() -> list[str]:
    lines = []
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            lines.append(entry.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # a process that ended while we looked
            continue
    return lines


def test_local_ray_runs_without_the_monitors_and_the_dashboard(ray_local):
    """``monitors`` and ``dashboard``: init_ray leaves out three polling processes nothing
    of ours reads, and a task's error still reaches the driver."""
    import ray
    from ray._private import ray_constants

    node = ray._private.worker._global_node
    session = node.get_session_dir_path()
    running = [cmd for cmd in _command_lines() if session in cmd]
    assert ray_constants.PROCESS_TYPE_RAYLET in node.all_processes
    if not switched_off("monitors"):
        assert ray_constants.PROCESS_TYPE_LOG_MONITOR not in node.all_processes, "monitors"
        assert ray_constants.PROCESS_TYPE_MONITOR not in node.all_processes, "monitors"
        assert not [cmd for cmd in running if "monitor.py" in cmd], "monitors"
    if not switched_off("dashboard"):
        assert ray_constants.PROCESS_TYPE_DASHBOARD not in node.all_processes, "dashboard"
        assert not [cmd for cmd in running if "dashboard.py" in cmd], "dashboard"

    @ray.remote(num_cpus=1)
    def fails() -> None:
        raise ValueError("a task's error still reaches the driver")

    with pytest.raises(ValueError, match="still reaches the driver"):
        ray.get(fails.remote())


def test_the_driver_finds_its_node_as_soon_as_it_registers(ray_local):
    """``node_poll``: the driver polls the GCS every 20 ms for its new raylet instead of
    Ray's lookup, which sleeps a second on a miss."""
    import ray

    node = ray._private.worker._global_node
    assert ray_private.wait_for_registration(node.gcs_address, node.node_id), "node_poll"
    assert not ray_private.wait_for_registration(node.gcs_address, "ab" * 28, patience_s=0.2)
    # a start on a busy machine gets longer than Ray's own fixed 30 s (node.py)
    assert ray_private.REGISTRATION_PATIENCE_S > 30


def _originals() -> list[object]:
    from ray._private import services
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    return [RayParams.__init__, Node.start_api_server, services.get_node]


def test_rays_own_start_is_back_after_the_local_start(monkeypatch):
    monkeypatch.delenv(ray_private.OFF_ENV, raising=False)
    before = _originals()
    with ray_private.lean_local_start():
        assert all(a is not b for a, b in zip(_originals(), before, strict=True))
    assert _originals() == before


def test_a_use_that_no_longer_applies_or_is_switched_off_leaves_ray_as_it_is(monkeypatch):
    """The fallback: Ray's own start where Ray has changed (here: the dashboard's
    ``start_api_server`` said to be gone) or where the run switches a use off."""
    before = _originals()
    monkeypatch.setitem(ray_private._CHECKS, "dashboard", lambda: "start_api_server is gone")
    monkeypatch.setenv(ray_private.OFF_ENV, "node_poll")
    with ray_private.lean_local_start():
        now = _originals()
        assert [a is b for a, b in zip(now, before, strict=True)] == [False, True, True]
    monkeypatch.setenv(ray_private.OFF_ENV, "all")
    assert not any(ray_private.applies(use) for use in USES)
    assert ray_private.worker_settings(2) == {}
    monkeypatch.setenv(ray_private.OFF_ENV, "prestart")
    assert ray_private.worker_settings(2) == {"RAY_num_workers_soft_limit": "6"}


def test_worker_settings_reach_ray_only_while_it_starts(monkeypatch):
    """The variables are set while Ray starts its processes and removed after; one the
    user set is neither replaced nor removed."""
    import os

    soft, prestart = "RAY_num_workers_soft_limit", "RAY_prestart_worker_first_driver"
    monkeypatch.setenv(soft, "40")
    monkeypatch.delenv(prestart, raising=False)
    with ray_private.environment({soft: "6", prestart: "0"}):
        assert (os.environ[soft], os.environ[prestart]) == ("40", "0")
    assert os.environ[soft] == "40" and prestart not in os.environ


# A fresh local instance of 2 CPUs (the session's has run other tests' tasks): how many
# worker processes it has before any task (``prestart``), and how many of eight task
# workers are left after 4 s idle (``soft_limit``: Ray's default keeps one per CPU).
_FRESH_DRIVER = """\
import json, os, time
from pathlib import Path
import ray
from ray._private import worker
from pairforge.config import RayConfig
from pairforge.pipeline.ray_runtime import init_ray

def workers(raylet):
    found = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        found += parent == raylet and "agent" not in command.lower()
    return found

init_ray(RayConfig(num_cpus=2, object_store_memory=100 * 1024**2))
raylet = worker._global_node.all_processes["raylet"][0].process.pid
time.sleep(1.5)
before = workers(raylet)
task = ray.remote(num_cpus=0.25)(lambda: time.sleep(1) or os.getpid())
pids = set(ray.get([task.remote() for _ in range(8)]))
time.sleep(4)
print(json.dumps({"before_tasks": before, "task_workers": len(pids),
                  "after_idle": workers(raylet)}))
"""


def test_workers_start_on_demand_and_outlive_a_pause():
    if switched_off("prestart") and switched_off("soft_limit"):
        pytest.skip("prestart and soft_limit are switched off by PAIRFORGE_RAY_PRIVATE_OFF")
    done = subprocess.run([sys.executable, "-c", _FRESH_DRIVER], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    if not switched_off("prestart"):
        assert seen["before_tasks"] == 0, f"prestart: Ray prestarted workers: {seen}"
    if not switched_off("soft_limit"):
        # up to 2 x 2 CPUs + 2 = 6 kept; Ray's default keeps 2 or 3 (one per CPU)
        assert seen["after_idle"] >= min(seen["task_workers"], 6) > 3, f"soft_limit: {seen}"


def test_a_shard_is_cut_in_the_task_before_it(ray_local):
    """``cut_blocks``: the cut asks the plain tasks' CPU fraction, so Ray fuses it into
    the task before it (a repartition asking a whole CPU could wait for the actor pools
    forever); the blocks hold at most the rows asked for."""
    _skip_if_switched_off("cut_blocks")
    import ray

    from pairforge.pipeline.ray_runtime import quiet_ray_data

    quiet_ray_data()
    ds = ray.data.from_items([{"x": i} for i in range(20)], override_num_blocks=1)
    ds = ds.map_batches(lambda batch: batch, batch_size=None, num_cpus=0.25)
    cut = ray_private.cut_into_blocks(ds, 6, num_cpus=0.25).materialize()
    sizes = [block.num_rows for block in cut.iter_batches(batch_size=None,
                                                           batch_format="pyarrow")]
    assert sorted(sizes) == [2, 6, 6, 6], "cut_blocks"
    assert "->StreamingRepartition" in cut.stats(), f"cut_blocks: not fused: {cut.stats()}"


def test_a_switched_off_cut_leaves_the_blocks_whole(monkeypatch, ray_local):
    import ray

    monkeypatch.setenv(ray_private.OFF_ENV, "cut_blocks")
    ds = ray.data.from_items([{"x": i} for i in range(20)], override_num_blocks=1)
    assert ray_private.cut_into_blocks(ds, 6, num_cpus=0.25) is ds


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:6379", True), ("localhost:6379", True), ("[::1]:6379", True),
    ("127.0.0.2:6379", False),  # the loopback cluster's nodes bind their own address
    ("10.0.0.1:6379", False), ("ray://127.0.0.1:10001", False)])
def test_only_a_loopback_address_is_joined_on_loopback(address, loopback, monkeypatch):
    from ray._private import ray_constants

    monkeypatch.delenv(ray_private.OFF_ENV, raising=False)
    assert ray_private.is_loopback_address(address) is loopback
    before = ray_constants.ENABLE_RAY_CLUSTER
    with ray_private.joining(address):
        assert ray_constants.ENABLE_RAY_CLUSTER is (before and not loopback)
    assert ray_constants.ENABLE_RAY_CLUSTER is before


_JOIN = """
import sys, ray
from pairforge.config import RayConfig
from pairforge.pipeline.ray_runtime import init_ray
init_ray(RayConfig(address=sys.argv[1]))
print(ray.get(ray.remote(num_cpus=0)(ray.util.get_node_ip_address).remote()),
      ray.get_runtime_context().gcs_address)
"""


def test_a_driver_joins_the_loopback_instance_pairforge_started(ray_local):
    """A local instance listens on loopback only; a second driver given its address (a user
    whose ``ray.address`` points at ``pairforge serve``'s Ray, or the suite's subprocesses)
    joins it there. Before ``joining``, Ray turned 127.0.0.1 into the host's address and
    the driver waited for a raylet that is not there, forever."""
    import ray

    gcs = ray.get_runtime_context().gcs_address
    assert ray_private.is_loopback_address(gcs)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", _JOIN, gcs], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["127.0.0.1", gcs]
