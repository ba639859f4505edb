"""Starting and stopping the service on Ray: local Ray by default, or ``ray.address``."""

from __future__ import annotations

import signal
import time

from pairforge.config import ConfigError, PairforgeConfig
from pairforge.pipeline.ray_runtime import init_ray
from pairforge.serve.app import APP_NAME, build_app, failed_deployments


def start_service(cfg: PairforgeConfig, host: str | None = None, port: int | None = None,
                  name: str = APP_NAME, route_prefix: str = "/") -> str:
    """Deploy the service (``host``/``port`` override ``serve.host``/``serve.port``) and
    return its base URL once the model replicas are built (their models loaded)."""
    from ray import serve

    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    app = build_app(cfg)  # config errors surface before Ray starts
    init_ray(cfg.ray)
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
    (a process manager's stop), then take the application down."""
    from ray import serve

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
