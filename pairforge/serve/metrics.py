"""An ingress replica's Prometheus metrics (``GET /metrics``), in its own registry.

Each ingress replica answers with its own counts: behind several, scrape each (or read
Ray Serve's own metrics, which the cluster's exporter aggregates). Model calls are counted
from the model replicas' replies (``ModelReply.calls``: each call once, to one caller).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServeMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only restate the start time
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pairforge_serve_requests", "caption requests answered, by "
                                "HTTP status", ["code"], registry=r)
        # by status: 30-s 504s and instant 4xx would otherwise drown the successes' latency
        self.latency = Histogram("pairforge_serve_request_seconds", "caption request latency "
                                 "(receipt to answer), by HTTP status", ["code"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("pairforge_serve_batch_size", "uploads per model call",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.cache = Counter("pairforge_serve_cache", "caption answers by cache tier "
                             "(exact, perceptual, embedding, miss)", ["tier"], registry=r)
        self.errors = Counter("pairforge_serve_errors", "refused or failed caption requests, "
                              "by kind", ["kind"], registry=r)
        self.in_flight = Gauge("pairforge_serve_in_flight", "caption requests being handled",
                               registry=r)
        self.cache_entries = Gauge("pairforge_serve_cache_entries", "captions in the cache "
                                   "of the model replica that answered last",
                                   registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
