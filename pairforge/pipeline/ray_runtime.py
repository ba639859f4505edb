"""Starting or joining Ray: a quiet local instance by default, a cluster when asked."""

from __future__ import annotations

import logging
import os

from pairforge.config import RayConfig

# Ray prints banners, dashboard hints and per-worker log lines; the user sees our
# progress display instead. Errors still surface as exceptions in the driver.
_QUIET_ENV = {
    "RAY_DEDUP_LOGS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_IMPORT_WARNING": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


def init_ray(cfg: RayConfig) -> None:
    """Join ``cfg.address`` / ``RAY_ADDRESS`` if set, else start a capped local instance."""
    import ray

    if ray.is_initialized():
        return
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    common = dict(logging_level=logging.ERROR, log_to_driver=False,
                  configure_logging=True)
    if address:
        ray.init(address=address, **common)
    else:
        ray.init(num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_memory,
                 include_dashboard=False, **common)
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
