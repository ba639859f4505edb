"""``pairforge serve``: the on-demand captioning service, a Ray Serve application.

One deployment, ``Captioner``, is both the HTTP ingress (FastAPI, which also serves the
OpenAPI page at ``/docs`` and ``/openapi.json``) and the model: a request is checked and
decoded on the replica's threads, then waits in Serve's ``@serve.batch`` queue, which
hands the model whatever arrived within ``batch_wait_timeout_s``, up to
``max_batch_size`` (opportunistic batching: a lone request is never held longer). The
model runs on one thread of its own, so the event loop keeps accepting, parsing and
answering health checks while a batch generates.

Routes: ``POST /v1/captions`` (serve/inputs.py says what it takes), ``GET /healthz`` (the
replica is up), ``GET /readyz`` (200 once its models are loaded, which happens in the
background after start), ``GET /metrics`` (serve/metrics.py).
"""

# no ``from __future__ import annotations``: FastAPI reads the routes' annotations (Request)
# at runtime, through Serve's ingress wrapper, which does not resolve string annotations

import asyncio
import hashlib
import hmac
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from ray import serve

from pairforge import __version__
from pairforge.config import ConfigError, PairforgeConfig
from pairforge.serve.captioning import Answer, ReplicaCaptioner
from pairforge.serve.inputs import (
    FORMS,
    RequestError,
    Upload,
    decode_upload,
    fetch_image,
    parse_body,
    url_fetcher,
)
from pairforge.serve.metrics import ServeMetrics

APP_NAME = "pairforge"
RETRY_AFTER_S = 5  # what a 503 asks a client to wait
log = logging.getLogger("pairforge.serve")


class Caption(BaseModel):
    """The answer of ``POST /v1/captions``."""

    caption: str | None  # null: the model abstained
    abstained: bool
    flags: list[str]  # what the safety checks did (attribute:*, regenerated:*, abstained:*)
    cache: str  # exact | perceptual | embedding | miss
    model: str
    latency_ms: float


class Problem(BaseModel):
    error: str
    detail: str


api = FastAPI(title="pairforge captions", version=__version__,
              description="On-demand captions from the build's captioner and safety checks.")
_BODY_DOC = {"requestBody": {"required": True, "description": FORMS, "content": {
    "image/*": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {"schema": {"type": "object", "properties": {
        "image": {"type": "string", "format": "binary"}}}},
    "application/json": {"schema": {"type": "object", "properties": {
        "url": {"type": "string"}, "image_base64": {"type": "string"}}}}}}}
_ERRORS = {code: {"model": Problem} for code in (400, 401, 403, 413, 415, 422, 503, 504)}


def token_digest(token: str) -> str:
    """What the replicas hold of the bearer token: its SHA-256, so the token itself never
    sits in Serve's deployment config."""
    return hashlib.sha256(token.encode()).hexdigest()


def _problem(err: RequestError) -> JSONResponse:
    return JSONResponse({"error": err.kind, "detail": err.message}, status_code=err.status,
                        headers=err.headers)


@serve.deployment(name="Captioner")
@serve.ingress(api)
class CaptionService:
    def __init__(self, cfg: PairforgeConfig, token_sha256: str | None) -> None:
        self.cfg, self.token_sha256 = cfg, token_sha256
        self.model_name = cfg.process.recaption.model
        self.metrics = ServeMetrics()
        self.captioner = ReplicaCaptioner(cfg)
        self.fetcher = url_fetcher(cfg)
        self.io = ThreadPoolExecutor(4, thread_name_prefix="pairforge-io")  # fetch, decode
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="pairforge-model")
        self.batch.set_max_batch_size(cfg.serve.max_batch_size)
        self.batch.set_batch_wait_timeout_s(cfg.serve.batch_wait_timeout_s)
        self.ready = threading.Event()
        self.load_error: str | None = None
        threading.Thread(target=self._load, daemon=True).start()

    def _load(self) -> None:
        try:
            self.captioner.load()
            self.ready.set()
        except Exception as err:  # reported by /readyz and Serve's health check
            self.load_error = f"{type(err).__name__}: {err}"
            log.exception("loading the captioner failed")

    def check_health(self) -> None:
        """Serve's health check: a replica whose models failed to load is replaced."""
        if self.load_error:
            raise RuntimeError(self.load_error)

    @api.get("/healthz")
    def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz", responses={503: {"model": Problem}})
    def readyz(self) -> Any:
        if self.ready.is_set():
            return {"status": "ready", "model": self.model_name}
        detail = self.load_error or "the captioner is still loading"
        return JSONResponse({"error": "not_ready", "detail": detail}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @api.get("/metrics", response_class=PlainTextResponse)
    def metrics(self) -> Response:
        self.metrics.cache_entries.set(len(self.captioner.cache))
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4")

    @api.post("/v1/captions", response_model=Caption, responses=_ERRORS,
              openapi_extra=_BODY_DOC)
    async def captions(self, request: Request) -> Any:
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            answer = await asyncio.wait_for(self._answer(request), self.cfg.serve.timeout_s)
            response: Response = JSONResponse(self._body(answer, started))
            self.metrics.cache.labels(answer.cache).inc()
        except RequestError as err:
            response = self._refuse(err)
        except TimeoutError:
            response = self._refuse(RequestError(
                504, "timeout", f"no answer within serve.timeout_s={self.cfg.serve.timeout_s}"))
        except Exception as err:  # a bug: answered as JSON like every other failure
            log.exception("a caption request failed")
            response = self._refuse(RequestError(500, "internal_error",
                                                 f"{type(err).__name__}: {err}"))
        finally:
            self.metrics.in_flight.dec()
        self.metrics.requests.labels(str(response.status_code)).inc()
        self.metrics.latency.observe(time.perf_counter() - started)
        return response

    def _refuse(self, err: RequestError) -> JSONResponse:
        self.metrics.errors.labels(err.kind).inc()
        return _problem(err)

    def _body(self, answer: Answer, started: float) -> dict[str, Any]:
        entry = answer.entry
        return Caption(caption=entry.recaption, abstained=entry.recaption is None,
                       flags=list(entry.flags), cache=answer.cache, model=self.model_name,
                       latency_ms=round((time.perf_counter() - started) * 1000, 2)).model_dump()

    async def _answer(self, request: Request) -> Answer:
        self._authorize(request)
        if not self.ready.is_set():
            raise RequestError(503, "not_ready", self.load_error or "the captioner is still "
                               "loading", {"Retry-After": str(RETRY_AFTER_S)})
        body = await self._read_body(request)
        loop = asyncio.get_running_loop()
        source = parse_body(request.headers.get("content-type"), body)
        if isinstance(source, str):
            source = await loop.run_in_executor(self.io, fetch_image, self.fetcher, source)
        upload = await loop.run_in_executor(self.io, decode_upload, source, self.cfg)
        return await self.batch(upload)

    def _authorize(self, request: Request) -> None:
        if self.token_sha256 is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token_digest(token.strip()), self.token_sha256):
            raise RequestError(401, "unauthorized", "a valid bearer token is required "
                               "(Authorization: Bearer TOKEN)", {"WWW-Authenticate": "Bearer"})

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to pass the cap."""
        cap = self.cfg.serve.max_body_bytes
        too_large = RequestError(413, "body_too_large",
                                 f"the body is over serve.max_body_bytes={cap}")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > cap:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def batch(self, uploads: list[Upload]) -> list[Answer]:
        """One model call for the uploads that arrived together (sizes set in __init__)."""
        self.metrics.batch_size.observe(len(uploads))
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.model_thread, self.captioner.caption,
                                              uploads)
        except Exception as err:  # the backend (a server, the device) failed: try later
            log.exception("captioning a batch failed")
            raise RequestError(503, "backend_unavailable",
                               f"the captioning backend failed: {type(err).__name__}: {err}",
                               {"Retry-After": str(RETRY_AFTER_S)}) from None


def deployment_options(cfg: PairforgeConfig) -> dict[str, Any]:
    """Replicas (or autoscaling), concurrency and the resources each replica reserves: the
    recaption section's, as the batch step's actors reserve them."""
    s, rc = cfg.serve, cfg.process.recaption
    actor: dict[str, Any] = {"num_cpus": rc.num_cpus, "num_gpus": rc.num_gpus}
    if rc.resources:
        actor["resources"] = dict(rc.resources)
    options: dict[str, Any] = {"ray_actor_options": actor,
                               "max_ongoing_requests": s.max_ongoing_requests,
                               "logging_config": {"enable_access_log": s.access_log}}
    if s.max_replicas is not None:
        options["autoscaling_config"] = {
            "min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
            "target_ongoing_requests": s.target_ongoing_requests}
    else:
        options["num_replicas"] = s.replicas
    return options


def bearer_token(cfg: PairforgeConfig) -> str | None:
    """The configured token's digest, read from its environment variable now."""
    name = cfg.serve.token_env
    if name is None:
        return None
    token = os.environ.get(name, "").strip()
    if not token:
        raise ConfigError(f"serve.token_env: the environment variable {name} is unset or "
                          "empty (set it, or set serve.token_env: null for no token)")
    return token_digest(token)


def build_app(cfg: PairforgeConfig) -> serve.Application:
    if not cfg.process.recaption.enabled:
        raise ConfigError("pairforge serve captions with process.recaption: set "
                          "process.recaption.enabled: true")
    return CaptionService.options(**deployment_options(cfg)).bind(cfg, bearer_token(cfg))
