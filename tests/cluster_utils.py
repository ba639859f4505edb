"""A real multi-node Ray cluster and an S3 server on loopback, for the cluster tests.

``LocalCluster`` starts a head and worker nodes with ``ray start --block``, each its own
process (and its own session, so one node can be SIGKILLed alone), all on NODE_IP with
free ports chosen here: other people run Ray on the same machine, so nothing uses Ray's
fixed defaults (6379, 8265, 52365) and nothing ever calls ``ray stop`` (which would
stop their clusters too). ``MotoServer`` runs moto's standalone S3 endpoint on 127.0.0.1.

Every process started here is stopped by its own pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Dummy credentials and a loopback endpoint: boto/s3fs must never reach AWS or the EC2
# metadata service (IMDS), whatever the machine's own configuration says.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
          "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

# Node death is noticed after period x threshold; Ray's defaults (3 s x 5) would leave a
# killed node "alive" for ~15 s. Read by the GCS on the head (RAY_<setting> env vars).
FAST_FAILURE_DETECTION = {"RAY_health_check_period_ms": "500",
                          "RAY_health_check_timeout_ms": "1000",
                          "RAY_health_check_failure_threshold": "3"}


# Ray replaces a node address of 127.0.0.1 (or localhost) by the machine's outward IP
# (services.resolve_ip_for_localhost), which would send the cluster's traffic to eth0's
# address. Another loopback address keeps every Ray connection on 127.0.0.0/8.
NODE_IP = "127.0.0.2"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process, from /proc (no psutil here)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                found[int(entry.name)] = (int(fields[1]), fields[19])
    return found


def family(pid: int) -> dict[int, str]:
    """``pid`` and every process below it, with their start times (a pid can be reused)."""
    table = _processes()
    if pid not in table:
        return {}
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = {}, [pid]
    while todo:
        current = todo.pop()
        found[current] = table[current][1]
        todo += children.get(current, [])
    return found


def kill_family(members: dict[int, str], sig: int = signal.SIGKILL) -> None:
    """Signal the processes of ``family()`` that are still the same processes."""
    table = _processes()
    for pid, started in members.items():
        if table.get(pid, (0, None))[1] == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


@dataclass
class RayNode:
    name: str
    proc: subprocess.Popen
    resources: dict[str, float]
    log: Path
    node_id: str | None = None

    def kill(self) -> None:
        """SIGKILL this node: the ``ray start`` process, its raylet, agents and workers."""
        kill_family(family(self.proc.pid), signal.SIGKILL)
        self.proc.wait(timeout=20)


@dataclass
class LocalCluster:
    """Head plus workers on NODE_IP; ``nodes`` maps a name to (num_cpus, resources)."""

    nodes: dict[str, tuple[int, dict[str, float]]]
    object_store_bytes: int = 120 * 1024**2
    env: dict[str, str] = field(default_factory=dict)
    started: dict[str, RayNode] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Short: Ray's unix sockets live under it and socket paths are limited to 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="pfray", dir="/tmp"))
        # Our own token: Ray turns token auth on when ~/.ray/auth_token exists (someone
        # else's local Ray may have made one); every process of this cluster uses ours.
        self.token = secrets.token_hex(32)
        self.gcs_port = free_port()

    @property
    def address(self) -> str:
        return f"{NODE_IP}:{self.gcs_port}"

    def _command(self, name: str, head: bool) -> list[str]:
        cpus, resources = self.nodes[name]
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
               "--node-ip-address", NODE_IP, "--num-cpus", str(cpus), "--num-gpus", "0",
               "--resources", json.dumps({f"node:{name}": 1, **resources}),
               "--object-store-memory", str(self.object_store_bytes),
               "--node-manager-port", str(free_port()),
               "--object-manager-port", str(free_port()),
               "--dashboard-agent-listen-port", str(free_port()),
               "--dashboard-agent-grpc-port", str(free_port()),
               "--runtime-env-agent-port", str(free_port()),
               "--metrics-export-port", str(free_port()),
               "--min-worker-port", "0", "--max-worker-port", "0",  # 0: the OS picks
               "--temp-dir", str(self.temp_dir), "--disable-usage-stats"]
        if head:
            return cmd + ["--head", "--port", str(self.gcs_port),
                          # No dashboard: ray[data] lacks its packages; placement is read
                          # from the GCS instead (see placement()).
                          "--include-dashboard", "false"]
        return cmd + ["--address", self.address]

    def _spawn(self, name: str, head: bool) -> None:
        log = self.temp_dir / f"{name}.log"
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **FAST_FAILURE_DETECTION,
               **self.driver_env, **self.env}
        env.pop("RAY_ADDRESS", None)
        with open(log, "wb") as out:
            proc = subprocess.Popen(self._command(name, head), stdout=out,
                                    stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # its own group: killable alone
        self.started[name] = RayNode(name, proc, self.nodes[name][1], log)

    def start(self, timeout: float = 120) -> LocalCluster:
        names = list(self.nodes)
        # The head gets a second try too: on a loaded machine `ray start --head` can miss
        # its deadline for the GCS's node info ("RPC error: Deadline Exceeded").
        for attempt in (1, 2):
            self._spawn(names[0], head=True)
            try:
                self._wait_alive(names[:1], timeout)
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                with contextlib.suppress(ProcessLookupError):  # what it left (its group)
                    os.killpg(self.started[names[0]].proc.pid, signal.SIGKILL)
                self.gcs_port = free_port()
        for i, name in enumerate(names[1:], start=2):
            # One at a time, and a second try: on a loaded machine a raylet can miss
            # `ray start`'s fixed 30 s registration deadline.
            for attempt in (1, 2):
                self._spawn(name, head=False)
                try:
                    self._wait_alive(names[:i], timeout)
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
        return self

    @property
    def driver_env(self) -> dict[str, str]:
        """Environment a driver (``pairforge build``) needs to join this cluster."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def _probe(self, what: str) -> Any:
        """Ask the cluster from a separate process: this one may already hold a local Ray
        (the ``ray_local`` fixture), and the token must not leak into it."""
        env = {**os.environ, **self.driver_env}
        env.pop("RAY_ADDRESS", None)
        result = subprocess.run([sys.executable, __file__, what, self.address], env=env,
                                capture_output=True, text=True, timeout=120)
        if result.returncode:
            raise RuntimeError(f"cluster probe {what} failed:\n{result.stderr[-3000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def alive_nodes(self) -> dict[str, str]:
        """node name -> node id of the nodes the cluster counts as alive."""
        return self._probe("nodes")

    def placement(self) -> dict[str, list[dict[str, Any]]]:
        """Ray's own record of where every task attempt and actor ran, from the GCS."""
        return self._probe("placement")

    def node_name(self, node_id: str) -> str:
        return next(n for n, node in self.started.items() if node.node_id == node_id)

    def _wait_alive(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in names:
                if self.started[name].proc.poll() is not None:
                    raise RuntimeError(f"ray node {name} exited:\n"
                                       f"{self.started[name].log.read_text()[-3000:]}")
            try:
                alive = self.alive_nodes()
            except Exception:  # noqa: BLE001 - the state API is not up yet
                alive = {}
            if all(n in alive for n in names):
                for n in names:
                    self.started[n].node_id = alive[n]
                return
            time.sleep(1)
        raise TimeoutError(f"ray nodes {names} not alive after {timeout} s")

    def restart(self, name: str, timeout: float = 120) -> None:
        """Start a worker node again under the same name (after ``kill``); other nodes
        killed before stay dead. A second try, as in ``start``: on a loaded machine a raylet
        can miss `ray start`'s fixed 30 s registration deadline (seen in CI's logs: "The
        current node timed out during startup")."""
        for attempt in (1, 2):
            self._spawn(name, head=False)
            try:
                self._wait_alive([name], timeout)
                return
            except RuntimeError:
                if attempt == 2:
                    raise

    def running(self, name: str, title: str) -> bool:
        """Whether a worker process of node ``name`` is executing ``title`` right now (Ray
        sets a worker's process title to ``ray::TASK`` while the task runs)."""
        for pid in family(self.started[name].proc.pid):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                    return True
        return False

    def wait_dead(self, name: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while name in self.alive_nodes():
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray node {name} still alive after {timeout} s")
            time.sleep(0.5)

    def stop(self) -> None:
        # SIGKILL, workers first: SIGTERM would make each node drain for up to 30 s, and
        # a test cluster has nothing worth draining (its temp dir goes too).
        for node in reversed(list(self.started.values())):
            if node.proc.poll() is None:
                node.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_coco_input(folder: Path, base_url: str, captions_csv: Path, n: int,
                     hold_s: float) -> Path:
    """An input list of ``n`` COCO photos served with a delay of ``hold_s`` each (so a
    download task lasts long enough to be killed mid-shard), row 8 a 404."""
    import csv

    with open(captions_csv, newline="") as f:
        rows = [(r["filename"], r["caption"].strip()) for r in csv.DictReader(f)][:n]
    lines = ["url,caption"] + [f"{base_url}/hold/{name}?secs={hold_s},\"{caption}\""
                               for name, caption in rows]
    lines[1 + 7] = f"{base_url}/status/404,gone"  # a failure travels through every stage
    path = folder / "in.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def build_config(input_path: str, output: str, address: str, shard_size: int,
                 storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A small full build: download, dedup, basic filters, VQ + byte tokens, t2i/i2t.
    The tokenize pool asks for ``gpu_like``, as a GPU pool asks for GPUs."""
    import pairforge

    vq32 = str(Path(pairforge.__file__).parent / "sample" / "vq32")
    opts = storage_options or {}
    return {"input": {"path": input_path, "shard_size": shard_size, "storage_options": opts},
            "output": {"path": output, "storage_options": opts},
            "ray": {"address": address},
            "download": {"threads": 2, "allow_addresses": ["127.0.0.1/32"],
                         "image": {"image_size": 64}},
            "process": {"basic": {"min_image_side": 64},
                        "tokenize": {"enabled": True, "batch_size": 8, "num_cpus": 0.5,
                                     "resources": {"gpu_like": 1},
                                     "image": {"backend": "pairforge-vq", "path_or_id": vq32},
                                     "text": {"backend": "bytes"}}}}


def start_build(cluster: LocalCluster, cfg: dict[str, Any], folder: Path,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """``pairforge build`` as a separate driver joining ``cluster``."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "build.yaml").write_text(yaml.safe_dump(cfg))
    full_env = {**os.environ, **cluster.driver_env, **(env or {})}
    full_env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "pairforge.cli", "build",
                             str(folder / "build.yaml"), "-q"], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 400) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class MotoServer:
    """moto's standalone S3 server (a real S3 protocol endpoint) on 127.0.0.1."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to talk to this server and to nothing else."""
        return {**S3_ENV, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_ENDPOINT_URL_S3": self.endpoint}

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.endpoint}}

    def start(self, timeout: float = 60) -> MotoServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env}, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("moto_server exited") from None
                time.sleep(0.3)
        raise TimeoutError("moto_server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _probe_nodes(address: str) -> dict[str, str]:
    from ray._raylet import GcsClient

    found = {}
    for node_id, info in GcsClient(address=address).get_all_node_info().items():
        if info.state != 0:  # GcsNodeInfo.ALIVE
            continue
        for resource in info.resources_total:
            if resource.startswith("node:") and resource[5:] != "__internal_head__":
                found.setdefault(resource[5:], node_id.hex())
    return {k: v for k, v in found.items() if not k.replace(".", "").isdigit()}


def _probe_placement(address: str) -> dict[str, list[dict[str, Any]]]:
    """Task attempts from the GCS task events, actors from the GCS actor table (the state
    API would need the dashboard, which ray[data] does not install)."""
    import ray
    from ray._private.state import state

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    tasks = []
    for event in state._get_all_task_events():
        if not event.HasField("task_info") or not event.state_updates.node_id:
            continue
        tasks.append({"name": event.task_info.name, "job": event.job_id.hex(),
                      "attempt": event.attempt_number,
                      "node": event.state_updates.node_id.hex()})
    actors = [{"class": a["ActorClassName"], "job": a["JobID"], "state": a["State"],
               "node": a["Address"]["NodeID"], "name": a["Name"]}
              for a in state.actor_table(None).values()]
    return {"tasks": tasks, "actors": actors}



# ---------------------------------------- for a driver joined to a LocalCluster (ray.init)

class ActorPlaces:
    """Where the actors named ``prefix``... that are made after this starts live, from the
    GCS's actor table every ``interval`` s, in a thread: ``places`` lists each change of
    an actor's (node, state) with the ``time.monotonic()`` it was seen (one clock for
    every process of the machine, so a test can compare it with its own)."""

    def __init__(self, prefix: str, interval: float = 0.1) -> None:
        import threading

        self.prefix = prefix
        self.interval = interval
        self.places: list[dict[str, Any]] = []
        self._earlier = {a["ActorID"] for a in self._actors()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _actors(self) -> list[dict[str, Any]]:
        from ray._private.state import state

        return [a for a in state.actor_table(None).values()
                if (a["Name"] or "").startswith(self.prefix)]

    def _watch(self) -> None:
        last: dict[str, tuple[str, str]] = {}
        while not self._stop.is_set():
            for actor in self._actors():
                place = (actor["Address"]["NodeID"], actor["State"])
                if actor["ActorID"] in self._earlier or last.get(actor["ActorID"]) == place:
                    continue
                last[actor["ActorID"]] = place
                self.places.append({"name": actor["Name"], "node": place[0],
                                    "state": place[1], "at": time.monotonic()})
            self._stop.wait(self.interval)

    def first_alive(self) -> dict[str, Any] | None:
        return next((p for p in list(self.places) if p["state"] == "ALIVE"), None)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return self.places


if __name__ == "__main__":
    kind, cluster_address = sys.argv[1], sys.argv[2]
    probe = {"nodes": _probe_nodes, "placement": _probe_placement}[kind]
    print(json.dumps(probe(cluster_address)))
