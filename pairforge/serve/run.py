"""Starting and stopping the service on Ray: local Ray by default, or ``ray.address``."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pairforge.config import ConfigError, PairforgeConfig
from pairforge.pipeline.ray_runtime import configure_front, haproxy_admin_sockets, init_ray
from pairforge.serve.app import APP_NAME, build_app, failed_deployments
from pairforge.serve.drain import drain

log = logging.getLogger("pairforge.serve")
# serve.drain_s of the service this process started last: what a stop waits for
_DRAIN_S: list[float] = []


@contextmanager
def _without_env(name: str | None) -> Iterator[None]:
    """``name`` out of the environment while Ray starts its processes, which inherit it:
    the token's digest is all the replicas need (``bearer_token``), and a token in every
    worker's environment could be read by anything that can read /proc there."""
    value = os.environ.pop(name, None) if name else None
    try:
        yield
    finally:
        if name and value is not None:
            os.environ[name] = value


def start_service(cfg: PairforgeConfig, host: str | None = None, port: int | None = None,
                  name: str = APP_NAME, route_prefix: str = "/") -> str:
    """Deploy the service (``host``/``port`` override ``serve.host``/``serve.port``) and
    return its base URL once the model replicas are built (their models loaded)."""
    from ray import serve

    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    # config errors surface before Ray starts; reads the token
    app = build_app(cfg.serve, cfg.process.recaption, cfg.process.clip, cfg.download)
    with _without_env(cfg.serve.token_env):
        init_ray(cfg.ray)
    configure_front(cfg.serve.model_copy(update={"host": host}))
    _DRAIN_S[:] = [cfg.serve.drain_s]
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(app, name=name, route_prefix=route_prefix, blocking=False)
    except RuntimeError as err:  # a deployment failed to start: say why, not just which
        failed = failed_deployments(name)
        raise ConfigError(f"pairforge serve could not start: {failed or err}") from None
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve_until_interrupted() -> None:
    """Keep the driver (and with a local Ray, the service) alive until Ctrl-C or SIGTERM
    (a process manager's stop), then drain and take the application down: HAProxy stops
    taking connections, the requests in flight get ``serve.drain_s`` to finish (a second
    signal cuts that short), and the process exits 0. With HAProxy off or on a cluster's
    Ray there is no local HAProxy to drain: Serve's own shutdown."""
    from ray import serve

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            took = drain(haproxy_admin_sockets(), _DRAIN_S[0] if _DRAIN_S else 0.0)
            log.info("drained in %.1f s", took)
        except KeyboardInterrupt:
            pass
        serve.shutdown()
