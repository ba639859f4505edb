"""``pairforge serve``: the on-demand captioning service, a Ray Serve application.

Two deployments. ``CaptionIngress`` is the HTTP side (FastAPI, which also serves the
OpenAPI page at ``/docs`` and ``/openapi.json``): it checks a request (token, body cap,
deadline), turns it into a decoded ``Upload`` (serve/inputs.py: the forms, the guarded
URL fetch, stage 1's image pass) on its threads (one pool parses bodies and decodes
images, another fetches URLs, so slow URLs cannot hold up uploads), and groups uploads
in Serve's ``@serve.batch`` queue, which hands over whatever arrived within
``batch_wait_timeout_s``, up to ``max_batch_size`` (opportunistic batching: a lone
request is never held longer).
Each batch goes in one handle call to ``CaptionModel`` (serve/model.py), which answers
from its cache or its captioner. The split keeps the request path (HTTP, PNG/JPEG
decoding, hashing) out of the model's process, whose interpreter a small captioner's
``generate`` keeps busy, and lets each side scale on its own resources.

Routes: ``POST /v1/captions`` (serve/inputs.py says what it takes), ``GET /healthz`` (the
ingress is up), ``GET /readyz`` (200 once a model replica is built, i.e. its models are
loaded), ``GET /metrics`` (serve/metrics.py).
"""

# no ``from __future__ import annotations``: FastAPI reads the routes' annotations (Request)
# at runtime, through Serve's ingress wrapper, which does not resolve string annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle

from pairforge import __version__
from pairforge.config import (
    ClipConfig,
    ConfigError,
    DownloadConfig,
    RecaptionConfig,
    ServeConfig,
)
from pairforge.pipeline.ray_private import bind_replica_grpc_to_node
from pairforge.serve.captioning import Answer
from pairforge.serve.inputs import (
    FORMS,
    UNREACHABLE,
    RequestError,
    Upload,
    decode_upload,
    fetch_image,
    parse_body,
    raise_pillow_cap,
    unreachable,
    url_fetcher,
)
from pairforge.serve.metrics import ServeMetrics
from pairforge.serve.model import CaptionModel, ModelReply

APP_NAME = "pairforge"
INGRESS_DEPLOYMENT = "CaptionIngress"
RETRY_AFTER_S = 5  # what a 503 asks a client to wait
READY_PROBE_S = 2.0  # how long /readyz waits for a model replica to answer
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


# Above the deployment class: the replica sees only the module globals its methods name
# that exist when the class is decorated (one defined below it was a NameError there;
# tests/test_serve.py::test_no_model_replica_yet_is_503_not_ready_with_retry_after).
def failed_deployments(app_name: str) -> str:
    """Serve's word on the application's deployments that failed to start or turned
    unhealthy (a model that does not load ends its replicas' constructor with the loader's
    error): what happened and the exception, without the traceback; "" if none did."""
    try:
        deployments = serve.status().applications[app_name].deployments
    except (KeyError, RuntimeError):
        return ""
    statuses = {name: getattr(d.status, "value", d.status) for name, d in deployments.items()}
    return "; ".join(f"{name} is {statuses[name]}: {_first_and_last_line(d.message)}"
                     for name, d in deployments.items()
                     if statuses[name] in ("DEPLOY_FAILED", "UNHEALTHY"))


def _first_and_last_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return " ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else ""


def answered(answer: Answer) -> Answer:
    """The answer, or 503 when the captioning server gave none for this upload: only this
    request fails, not the others its batch was merged with. Defined before the ingress:
    Serve ships the class with the module globals it finds when it is decorated."""
    failure = answer.failure()
    if failure is not None:
        raise RequestError(503, "backend_unavailable", failure,
                           {"Retry-After": str(RETRY_AFTER_S)})
    return answer


@serve.deployment(name=INGRESS_DEPLOYMENT)
@serve.ingress(api)
class CaptionIngress:
    def __init__(self, model: DeploymentHandle, s: ServeConfig, download: DownloadConfig,
                 model_name: str, token_sha256: str | None) -> None:
        """``download``: stage 1's fetcher and image pass, which the service reuses."""
        bind_replica_grpc_to_node()  # before Serve starts this replica's gRPC server
        self.model, self.serve, self.token_sha256 = model, s, token_sha256
        self.image, self.model_name = download.image, model_name
        self.metrics = ServeMetrics()
        self.fetcher = url_fetcher(s, download)
        # two pools: slow URLs fill their own (bounded) pool and never delay an upload's
        # parsing and decoding (one shared pool of 4: 12 slow URLs held an upload 14.6 s)
        self.url_pool = ThreadPoolExecutor(s.url_threads, thread_name_prefix="pairforge-url")
        self.decode_pool = ThreadPoolExecutor(s.decode_threads,
                                              thread_name_prefix="pairforge-decode")
        raise_pillow_cap(s.max_image_pixels)
        # once true, stays: a model replica answers only once its models are loaded
        self.model_ready = False
        self.batch = serve.batch(max_batch_size=s.max_batch_size,
                                 batch_wait_timeout_s=s.batch_wait_timeout_s,
                                 # closed batches go on: the model merges those that
                                 # wait for it (serve/model.py)
                                 max_concurrent_batches=max(
                                     1, s.max_ongoing_requests // s.max_batch_size),
                                 )(self._caption)

    async def _probe_model(self) -> str | None:
        """None once a model replica answers; else why not (loading, or failed to load)."""
        if self.model_ready:
            return None
        response = self.model.ready.remote()
        try:
            await asyncio.wait_for(asyncio.shield(response), READY_PROBE_S)
            self.model_ready = True
            return None
        except TimeoutError:
            response.cancel()
        app_name = serve.get_replica_context().replica_id.deployment_id.app_name
        failed = await asyncio.to_thread(failed_deployments, app_name)
        return failed or "the captioner is still loading"

    @api.get("/healthz")
    def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz", responses={503: {"model": Problem}})
    async def readyz(self) -> Any:
        problem = await self._probe_model()
        if problem is None:
            return {"status": "ready", "model": self.model_name}
        return JSONResponse({"error": "not_ready", "detail": problem}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @api.get("/metrics", response_class=PlainTextResponse)
    def metrics(self) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4")

    @api.post("/v1/captions", response_model=Caption, responses=_ERRORS,
              openapi_extra=_BODY_DOC)
    async def captions(self, request: Request) -> Any:
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            answer = await asyncio.wait_for(self._answer(request), self.serve.timeout_s)
            response: Response = JSONResponse(self._body(answer, started))
            self.metrics.cache.labels(answer.cache).inc()
        except RequestError as err:
            response = self._refuse(err)
        except TimeoutError:
            response = self._refuse(RequestError(
                504, "timeout", f"no answer within serve.timeout_s={self.serve.timeout_s}"))
        except Exception as err:  # a bug: answered as JSON like every other failure
            log.exception("a caption request failed")
            response = self._refuse(RequestError(500, "internal_error",
                                                 f"{type(err).__name__}: {err}"))
        finally:
            self.metrics.in_flight.dec()
        code = str(response.status_code)
        self.metrics.requests.labels(code).inc()
        self.metrics.latency.labels(code).observe(time.perf_counter() - started)
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
        problem = await self._probe_model()
        if problem is not None:
            raise RequestError(503, "not_ready", problem, {"Retry-After": str(RETRY_AFTER_S)})
        s = self.serve
        try:
            async with asyncio.timeout(s.http_request_timeout_s):  # no task of its own
                body = await self._read_body(request)
        except TimeoutError:
            raise RequestError(408, "body_timeout", "the body did not arrive within "
                               f"serve.http_request_timeout_s={s.http_request_timeout_s}") \
                from None
        loop = asyncio.get_running_loop()
        # one hop to the decode threads for parsing and decoding (each hop is a wait for
        # a thread, and then for the loop, on a busy host)
        upload = await loop.run_in_executor(self.decode_pool, self._upload,
                                            request.headers.get("content-type"), body)
        if isinstance(upload, str):  # a URL: fetched on the URL pool, then decoded
            data = await self._fetch(upload)
            upload = await loop.run_in_executor(self.decode_pool, decode_upload, data,
                                                self.serve, self.image)
        return answered(await self.batch(upload))

    def _upload(self, content_type: str | None, body: bytes) -> Upload | str:
        """The body parsed and its image decoded, or the URL a JSON body names."""
        source = parse_body(content_type, body, self.serve.max_multipart_parts)
        return (source if isinstance(source, str)
                else decode_upload(source, self.serve, self.image))

    async def _fetch(self, url: str) -> bytes:
        """The image at ``url``, fetched on the URL pool within ``serve.url_timeout_s``
        (the whole fetch, the wait for a thread included). A failure is answered no
        sooner than the deadline, so neither its kind nor its timing tells a refused
        connection (a closed port) from one that does not answer."""
        deadline = self.serve.url_timeout_s
        started = time.monotonic()
        fetch = asyncio.get_running_loop().run_in_executor(self.url_pool, fetch_image,
                                                           self.fetcher, url)
        try:
            return await asyncio.wait_for(fetch, deadline)
        except TimeoutError:
            raise unreachable() from None
        except RequestError as err:
            if err.kind == UNREACHABLE:
                await asyncio.sleep(max(0.0, deadline - (time.monotonic() - started)))
            raise

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
        cap = self.serve.max_body_bytes
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

    async def _caption(self, uploads: list[Upload]) -> list[Answer]:
        """The uploads that arrived together (``self.batch``), in one handle call."""
        try:
            reply: ModelReply = await self.model.caption.remote(uploads)
        except Exception as err:  # the model replica died or could not be reached
            log.exception("a batch did not reach the model")
            reply = ModelReply(None, 0, failure=f"the model deployment failed: "
                               f"{type(err).__name__}: {err}")
        for size in reply.calls:
            self.metrics.batch_size.observe(size)
        if reply.answers is None:
            raise RequestError(503, "backend_unavailable", reply.failure or "",
                               {"Retry-After": str(RETRY_AFTER_S)})
        self.metrics.cache_entries.set(reply.cache_entries)
        return reply.answers


def model_options(s: ServeConfig, rc: RecaptionConfig) -> dict[str, Any]:
    """The model deployment's replicas (or autoscaling) and the resources each reserves:
    the recaption section's, as the batch step's actors reserve them. Its requests are
    batches."""
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


def ingress_options(s: ServeConfig) -> dict[str, Any]:
    return {"num_replicas": s.ingress_replicas,
            "ray_actor_options": {"num_cpus": s.ingress_num_cpus},
            "max_ongoing_requests": s.max_ongoing_requests,
            "logging_config": {"enable_access_log": s.access_log}}


def bearer_token(s: ServeConfig) -> str | None:
    """The configured token's digest, read from its environment variable now."""
    name = s.token_env
    if name is None:
        return None
    token = os.environ.get(name, "").strip()
    if not token:
        raise ConfigError(f"serve.token_env: the environment variable {name} is unset or "
                          "empty (set it, or set serve.token_env: null for no token)")
    return token_digest(token)


def build_app(s: ServeConfig, rc: RecaptionConfig, clip: ClipConfig,
              download: DownloadConfig) -> serve.Application:
    """The two deployments, each bound to the sections it reads: the model replicas to
    the recaption section (and clip's, for clip grounding or the cache's CLIP tier), the
    ingress to stage 1's fetcher and image pass."""
    if not rc.enabled:
        raise ConfigError("pairforge serve captions with process.recaption: set "
                          "process.recaption.enabled: true")
    model = CaptionModel.options(**model_options(s, rc)).bind(s, rc, clip)
    return CaptionIngress.options(**ingress_options(s)).bind(model, s, download, rc.model,
                                                              bearer_token(s))
