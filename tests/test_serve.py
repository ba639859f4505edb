"""``pairforge serve``: the real Ray Serve application on local Ray, called over HTTP on
127.0.0.1, with the demo's captioner (pairforge/sample/captioner, a small BLIP taught the
bundled scenes, so its captions depend on the image).

One service starts per module (Serve's start costs tens of seconds on a loaded machine):
``pairforge`` at ``/`` with a bearer token, and ``down`` at ``/down``, whose backend is an
OpenAI-compatible server that is not there. The cache and request parsing also have
tests of their own, without Serve.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import requests
from conftest import COCO_IMAGES
from loopback_server import LoopbackServer, make_bomb_png, make_images
from PIL import Image

from pairforge.config import ServeCacheConfig, parse_config
from pairforge.download.imageproc import process_image
from pairforge.recaption.cache import CachedCaption
from pairforge.serve.cache import EMBEDDING, EXACT, PERCEPTUAL, ServeCache
from pairforge.serve.inputs import RequestError, parse_body

SAMPLE = Path(__file__).resolve().parents[1] / "pairforge" / "sample"
SCENES = sorted((SAMPLE / "images").glob("*.png"))
TOKEN_ENV, TOKEN = "PAIRFORGE_TEST_SERVE_TOKEN", "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**serve) -> dict:
    return {"input": {"path": "unused"},
            "download": {"allow_addresses": ["127.0.0.1/32"],
                         "image": {"image_size": 32, "encode_format": "png"}},
            "process": {"recaption": {"enabled": True, "model": str(SAMPLE / "captioner"),
                                      "max_new_tokens": 24, "grounding": {"enabled": False},
                                      "cache": {"enabled": False}}},
            # ingress replicas reserve little: three apps share the 2 CPUs of ray_local
            "serve": {"ingress_num_cpus": 0.1, "max_body_bytes": 100_000,
                      "allow_addresses": ["127.0.0.1/32"],
                      "max_image_pixels": 1_000_000,
                      "url_timeout_s": 1.0, "max_batch_size": 8,
                      "batch_wait_timeout_s": 0.05, **serve}}


@pytest.fixture(scope="module")
def images_server(tmp_path_factory) -> Iterator[LoopbackServer]:
    directory = tmp_path_factory.mktemp("serve_images")
    make_images(directory)
    with LoopbackServer(directory, "127.0.0.1") as server:
        yield server


@pytest.fixture(scope="module")
def service(ray_local) -> Iterator[str]:
    from ray import serve

    from pairforge.serve.run import start_service

    os.environ[TOKEN_ENV] = TOKEN
    port = _free_port()
    url = start_service(parse_config(_config(token_env=TOKEN_ENV)), "127.0.0.1", port)
    closed = _free_port()  # nothing listens there: the backend is down
    down = _config()
    down["process"]["recaption"].update(backend="openai", model="served-captioner", openai={
        "base_url": f"http://127.0.0.1:{closed}/v1", "retries": 0, "timeout_s": 2})
    start_service(parse_config(down), "127.0.0.1", port, name="down", route_prefix="/down")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/readyz", timeout=5).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    yield url
    serve.shutdown()
    os.environ.pop(TOKEN_ENV, None)


def _post(url: str, data: bytes, content_type: str = "image/png", **kw) -> requests.Response:
    return requests.post(url + "/v1/captions", data=data, timeout=60,
                         headers={"Content-Type": content_type, **AUTH, **kw.pop("headers", {})},
                         **kw)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


# -- over HTTP ---------------------------------------------------------------------------------

def test_haproxy_takes_the_connections_and_picks_free_ports(service, monkeypatch) -> None:
    """The local Ray runs Serve in its high-throughput mode: HAProxy, not Serve's Python
    proxy actor, listens on the service's port (a Ray that stops honouring the variables
    would leave the proxy actor there). Its stats and metrics ports are picked free, and a
    value the user set is kept (``ray_private.environment``)."""
    import psutil

    from pairforge.pipeline.ray_private import environment
    from pairforge.pipeline.ray_runtime import serve_settings

    port = int(service.rsplit(":", 1)[1])
    owners = {psutil.Process(c.pid).name() for c in psutil.net_connections("tcp")
              if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}
    assert owners == {"haproxy"}
    settings = serve_settings()
    assert settings["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert settings["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    stats, metrics = (int(settings[f"RAY_SERVE_HAPROXY_{name}_PORT"])
                      for name in ("STATS", "METRICS"))
    assert stats != metrics and port not in (stats, metrics)
    fallback = {int(settings[f"RAY_SERVE_FALLBACK_PROXY_{name}_PORT"]) for name in ("HTTP",
                                                                                  "GRPC")}
    assert len(fallback) == 2 and not fallback & {8500, 9500, stats, metrics}
    assert settings["SERVE_SOCKET_REUSE_PORT_ENABLED"] == "0"
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    with environment(settings):
        assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
        assert os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] == str(metrics)
    # HAProxy off, or no binary: no HAProxy setting (THROUGHPUT_OPTIMIZED alone would leave
    # no proxy on the port), so Serve's own proxy actor takes the connections; its ports
    # are still free ones, never shared
    base = {"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
            "SERVE_SOCKET_REUSE_PORT_ENABLED", "RAY_enable_metrics_collection"}
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    assert serve_settings().keys() == base
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/haproxy")
    assert serve_settings().keys() == base


def test_every_form_of_upload_gets_the_caption_and_the_cache_answers_repeats(
        service, images_server) -> None:
    scene = SCENES[0].read_bytes()
    first = _post(service, scene)
    assert first.status_code == 200, first.text
    answer = first.json()
    assert set(answer) == {"caption", "abstained", "flags", "cache", "model", "latency_ms"}
    assert answer["cache"] == "miss" and answer["abstained"] is False
    assert answer["caption"] and answer["model"].endswith("captioner")
    again = [_post(service, scene),
             requests.post(service + "/v1/captions", files={"image": ("s.png", scene)},
                           headers=AUTH, timeout=60),
             requests.post(service + "/v1/captions", headers=AUTH, timeout=60,
                           json={"image_base64": base64.b64encode(scene).decode()})]
    for response in again:
        assert response.status_code == 200, response.text
        assert response.json()["cache"] == "exact"
        assert response.json()["caption"] == answer["caption"]
    fetched = requests.post(service + "/v1/captions", json={"url": images_server.url(
        "/img/blue.png")}, headers=AUTH, timeout=60)
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["cache"] == "miss" and images_server.hits("/img/blue.png") == 1


def test_same_caption_as_the_batch_step(service, ray_local) -> None:
    """Stage 3's recaption step over the raw-shard bytes stage 1 makes of each scene, and
    the service over the original file: the same captions (same config, greedy)."""
    from pairforge.pipeline.contract import step_config
    from pairforge.recaption.step import RecaptionStep

    cfg = parse_config(_config())
    picked = SCENES[10:14]
    raw = [process_image(p.read_bytes(), cfg.download.image) for p in picked]
    table = pa.table({"key": [f"{i:09d}" for i in range(len(raw))],
                      "image": [r.data for r in raw], "caption": ["x"] * len(raw),
                      "pixel_hash": [r.pixel_hash for r in raw],
                      "phash": pa.array([r.phash for r in raw], pa.uint64())})
    batch = RecaptionStep(step_config(cfg)).process(table).columns["recaption"]
    served = [_post(service, p.read_bytes()).json()["caption"] for p in picked]
    assert served == batch
    assert len(set(served)) > 1  # the captions depend on the image


def test_concurrent_uploads_share_model_batches(service) -> None:
    before = requests.get(service + "/metrics", timeout=10).text
    photos = [p.read_bytes() for p in sorted(COCO_IMAGES.glob("*.jpg"))[:8]]
    results: list[requests.Response] = [None] * len(photos)  # type: ignore[list-item]

    def send(i: int) -> None:
        results[i] = _post(service, photos[i], "image/jpeg")

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(photos))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * len(photos)
    after = requests.get(service + "/metrics", timeout=10).text
    batches = (_metric(after, "pairforge_serve_batch_size_count")
               - _metric(before, "pairforge_serve_batch_size_count"))
    uploads = (_metric(after, "pairforge_serve_batch_size_sum")
               - _metric(before, "pairforge_serve_batch_size_sum"))
    assert uploads == len(photos)
    assert batches < len(photos)  # some requests shared a generate call


def _stalling_listener() -> socket.socket:
    """Accepts connections on 127.0.0.1 and never answers: a URL that times out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener


def test_bad_input_is_a_4xx_naming_the_problem_and_the_service_keeps_serving(
        service, images_server) -> None:
    scene = SCENES[1].read_bytes()
    refused = LoopbackServer(None, "127.0.0.2").start()
    stall = _stalling_listener()
    stall_port = stall.getsockname()[1]
    try:
        cases = [
            (_post(service, b"plain text, not pixels"), 422, "not_an_image"),
            (_post(service, scene[:len(scene) // 2]), 422, "decode_error"),
            (_post(service, make_bomb_png(2000)), 413, "image_too_large"),
            (_post(service, bytes(100_001)), 413, "body_too_large"),
            (_post(service, b"hello", "text/plain"), 415, "unsupported_media_type"),
            (_post(service, b"{not json", "application/json"), 400, "malformed_json"),
            (_post(service, json.dumps({"url": refused.url("/img/red.jpg")}).encode(),
                   "application/json"), 403, "url_blocked_address"),
            (_post(service, json.dumps({"url": f"http://127.0.0.1:{stall_port}/x.png"}
                                       ).encode(),
                   "application/json"), 422, "url_unreachable"),
            (_post(service, json.dumps({"url": "file:///etc/hostname"}).encode(),
                   "application/json"), 400, "url_invalid_url"),
            (requests.post(service + "/v1/captions", data=scene, timeout=60,
                           headers={"Content-Type": "image/png"}), 401, "unauthorized"),
            (_post(service, scene, headers={"Authorization": "Bearer wrong"}), 401,
             "unauthorized"),
        ]
        assert refused.requests_seen == 0  # the guard refused before connecting
    finally:
        refused.stop()
        stall.close()
    for response, status, kind in cases:
        assert (response.status_code, response.json().get("error")) == (status, kind), \
            response.text
        assert response.json()["detail"]
    assert cases[-1][0].headers["WWW-Authenticate"] == "Bearer"
    assert _post(service, scene).status_code == 200
    metrics = requests.get(service + "/metrics", timeout=10).text
    assert _metric(metrics, 'pairforge_serve_errors_total{kind="unauthorized"}') == 2
    assert _metric(metrics, 'pairforge_serve_errors_total{kind="image_too_large"}') == 1


def test_a_client_that_disconnects_mid_body_leaves_nothing_stuck(service) -> None:
    port = int(service.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/captions HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                     b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                     b"Content-Length: 5000\r\n\r\n" + SCENES[2].read_bytes()[:100])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = requests.get(service + "/metrics", timeout=10).text
        if _metric(metrics, "pairforge_serve_in_flight") == 0:
            break
        time.sleep(0.2)
    assert _metric(metrics, "pairforge_serve_in_flight") == 0
    assert _post(service, SCENES[2].read_bytes()).status_code == 200


def test_health_readiness_metrics_and_openapi(service) -> None:
    assert requests.get(service + "/healthz", timeout=10).json() == {"status": "ok"}
    ready = requests.get(service + "/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    _post(service, SCENES[3].read_bytes())
    _post(service, SCENES[3].read_bytes())
    metrics = requests.get(service + "/metrics", timeout=10)
    assert metrics.headers["content-type"].startswith("text/plain")
    for series in ('pairforge_serve_requests_total{code="200"}',
                   'pairforge_serve_cache_total{tier="exact"}',
                   'pairforge_serve_cache_total{tier="miss"}',
                   "pairforge_serve_request_seconds_bucket", "pairforge_serve_batch_size_count",
                   "pairforge_serve_cache_entries"):
        assert _metric(metrics.text, series) >= 1, series
    spec = requests.get(service + "/openapi.json", timeout=10).json()
    body = spec["paths"]["/v1/captions"]["post"]["requestBody"]["content"]
    assert {"image/*", "multipart/form-data", "application/json"} <= body.keys()


def test_a_backend_that_is_down_is_503_with_retry_after(service) -> None:
    down = service + "/down"
    assert requests.get(down + "/readyz", timeout=10).status_code == 200
    for _ in range(2):  # and again: the replica survives its backend
        response = requests.post(down + "/v1/captions", data=SCENES[4].read_bytes(),
                                 headers={"Content-Type": "image/png"}, timeout=60)
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "backend_unavailable"
        assert int(response.headers["Retry-After"]) > 0
    assert requests.get(down + "/healthz", timeout=10).status_code == 200


def test_no_model_replica_yet_is_503_not_ready_with_retry_after(service) -> None:
    """Autoscaling from zero: the ingress is up before any model replica; /readyz and a
    caption request say so at once (the probe waits 2 s), and the service keeps serving."""
    from ray import serve

    from pairforge.serve.run import start_service

    port = int(service.rsplit(":", 1)[1])
    cold = start_service(parse_config(_config(min_replicas=0, max_replicas=1)), "127.0.0.1",
                         port, name="cold", route_prefix="/cold")
    try:
        ready = requests.get(cold + "/readyz", timeout=30)
        caption = requests.post(cold + "/v1/captions", data=SCENES[5].read_bytes(),
                                headers={"Content-Type": "image/png"}, timeout=30)
    finally:
        serve.delete("cold")
    for response in (ready, caption):
        assert response.status_code == 503, response.text
        assert response.json() == {"error": "not_ready",
                                   "detail": "the captioner is still loading"}
        assert int(response.headers["Retry-After"]) > 0
    assert requests.get(service + "/readyz", timeout=10).status_code == 200


# -- without Serve -----------------------------------------------------------------------------

def test_parse_body_forms() -> None:
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    data = png.getvalue()
    assert parse_body("image/png", data, 8) == data
    assert parse_body("application/json", json.dumps({"url": " http://a/b "}).encode(), 8) \
        == "http://a/b"
    boundary = "XyZ"
    multipart = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n"
                 f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; "
                 f"filename=\"a.png\"\r\nContent-Type: image/png\r\n\r\n").encode() + data \
        + f"\r\n--{boundary}--\r\n".encode()
    assert parse_body(f"multipart/form-data; boundary={boundary}", multipart, 8) == data
    note = b'--XyZ\r\nContent-Disposition: form-data; name="n"\r\n\r\nx\r\n'
    for content_type, body, status, kind in [
            ("multipart/form-data", b"junk", 400, "malformed_multipart"),
            ("multipart/form-data; boundary=XyZ", note * 4 + b"--XyZ--\r\n", 400,
             "too_many_parts"),
            ("multipart/form-data; boundary=XyZ", note + b"--XyZ--\r\n", 400, "no_image_part"),
            ("application/json", b"[" * 100_000, 400, "malformed_json"),
            ("application/json", b'{"image_base64": "***"}', 400, "malformed_base64"),
            ("application/json", b"[1]", 400, "malformed_json"),
            ("image/png", b"", 400, "empty_image"),
            (None, data, 415, "unsupported_media_type")]:
        with pytest.raises(RequestError) as err:
            parse_body(content_type, body, 3)
        assert (err.value.status, err.value.kind) == (status, kind)


def _entry(text: str | None) -> CachedCaption:
    return CachedCaption(text, () if text else ("abstained:empty",))


def test_serve_cache_tiers_exclusions_and_lru_bound() -> None:
    cache = ServeCache(ServeCacheConfig(max_entries=3, phash_distance=2,
                                        embedding_threshold=0.9))
    east, north = np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)
    cache.add("a", 0b1111, _entry("A dog on grass."), east)
    cache.add("b", 0b11110000, _entry("A sign that reads stop."), north)  # mentions text
    cache.add("c", 0xFF00, _entry(None), north)  # an abstention
    assert cache.lookup("a", None) == (_entry("A dog on grass."), EXACT)
    assert cache.lookup("c", None)[0].recaption is None  # exact pixels: even an abstention
    assert cache.lookup("new", 0b1100) == (_entry("A dog on grass."), PERCEPTUAL)
    assert cache.lookup("new", 0b11110011) is None  # near "b" only, which mentions text
    assert cache.nearest(np.array([0.99, 0.14], np.float32)) == (_entry("A dog on grass."),
                                                                 EMBEDDING)
    assert cache.nearest(north) is None  # "b" and "c" are never reused by similarity
    cache.lookup("b", None)
    cache.lookup("a", None)  # least recently used first: c, b, a
    cache.add("d", None, _entry("A cat."))
    assert len(cache) == 3 and cache.evictions == 1
    assert cache.lookup("c", None) is None  # the least recently used went
    assert list(cache.slots) == ["b", "a", "d"]
    cache.add("e", None, _entry("A bus."))
    cache.add("f", None, _entry("A train."))
    assert list(cache.slots) == ["d", "e", "f"] and cache.evictions == 3
    assert cache.lookup("new", 0b1100) is None  # the evicted slots' hashes went with them
    assert cache.nearest(east) is None  # and their vectors


def test_serve_verb_names_config_problems_before_ray_starts(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from pairforge.cli import app

    config = tmp_path / "serve.yaml"
    config.write_text(json.dumps(_config(token_env=TOKEN_ENV)))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    runner = CliRunner()
    unset = runner.invoke(app, ["serve", str(config)])
    assert unset.exit_code == 2 and TOKEN_ENV in unset.output
    off = runner.invoke(app, ["serve", str(config), "--set", "serve.token_env=null",
                              "--set", "process.recaption.enabled=false"])
    assert off.exit_code == 2 and "process.recaption.enabled" in off.output
    pair = runner.invoke(app, ["serve", str(config), "--set", "serve.min_replicas=1"])
    assert pair.exit_code == 2 and "max_replicas" in pair.output
    missing = runner.invoke(app, ["serve", str(config), "--set", "serve.token_env=null",
                                  "--set", f"process.recaption.model={tmp_path / 'none'}"])
    assert missing.exit_code == 2 and "process.recaption.model" in missing.output
    assert "serve cannot start" in missing.output and "Traceback" not in missing.output


def test_replica_captioner_tiers_and_batch_duplicates() -> None:
    """Without Serve: the embedding tier answers a re-shot scene with the captioner's own
    vectors, and duplicates within a batch run the model once."""
    from pairforge.serve.captioning import ReplicaCaptioner
    from pairforge.serve.inputs import decode_upload

    cfg = parse_config(_config(cache={"embedding_threshold": 0.98}))
    replica = ReplicaCaptioner(cfg.process.recaption, cfg.process.clip, cfg.serve.cache)
    replica.load()
    calls: list[int] = []
    generate = replica.checked.captioner.generate
    replica.checked.captioner.generate = lambda images, prompt: (
        calls.append(len(images)) or generate(images, prompt))
    scene = decode_upload(SCENES[20].read_bytes(), cfg.serve, cfg.download.image)
    other = decode_upload(SCENES[21].read_bytes(), cfg.serve, cfg.download.image)
    first = replica.caption([scene, other, scene])
    assert [a.cache for a in first] == ["miss", "miss", "miss"]
    assert first[0].entry == first[2].entry and calls == [2]  # one generate, two images
    shifted = scene.image.copy()
    shifted.putpixel((0, 0), (0, 0, 0))  # other pixels, so another pixel hash
    reshot = decode_upload(_png(shifted), cfg.serve, cfg.download.image)
    assert reshot.pixel_hash != scene.pixel_hash
    again = replica.caption([scene, reshot])
    assert [a.cache for a in again] == ["exact", "embedding"]
    assert again[1].entry == first[0].entry and calls == [2]


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_batches_waiting_for_the_model_merge_into_its_next_call() -> None:
    """The model deployment's caller: batches that arrive during a call go together in the
    next one (up to max_size; a larger one alone), a caller that gave up is skipped, every
    call's size is reported once, and a failure reaches every merged caller."""
    import asyncio

    from pairforge.serve.model import MergingCaller

    started, release = threading.Event(), threading.Event()
    calls: list[list] = []

    def fn(items: list) -> list:
        calls.append(list(items))
        if len(calls) == 1:
            started.set()
            release.wait(10)
        if "down" in items:
            raise ConnectionError("the backend is down")
        return [item * 10 for item in items]

    async def run(later: list[list]) -> list:
        call = MergingCaller(fn, max_size=4)
        first = asyncio.create_task(call([1]))
        await asyncio.to_thread(started.wait, 10)
        waiting = [asyncio.create_task(call(batch)) for batch in later]
        gone = asyncio.create_task(call([99]))
        await asyncio.sleep(0.05)
        gone.cancel()  # its client went away before the model was free
        release.set()
        return await asyncio.gather(first, *waiting)

    replies = asyncio.run(run([[2, 3], [4], [5], [6, 7, 8, 9, 10]]))
    assert calls == [[1], [2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert [r[0] for r in replies] == [[10], [20, 30], [40], [50], [60, 70, 80, 90, 100]]
    assert [r[1] for r in replies] == [[1], [4], [], [], [5]]
    assert {r[2] for r in replies} == {None}

    calls.clear()
    started.clear()
    release.clear()
    failed = asyncio.run(run([["down"], [7]]))
    assert calls == [[1], ["down", 7]]
    assert [r[0] for r in failed] == [[10], None, None]
    assert "ConnectionError: the backend is down" in failed[1][2] and failed[1][2] == failed[2][2]


def test_deployment_options_fixed_or_autoscaling() -> None:
    from pairforge.serve.app import ingress_options, model_options

    def model_options_of(cfg):  # noqa: ANN001, ANN202
        return model_options(cfg.serve, cfg.process.recaption)

    fixed = model_options_of(parse_config(_config(replicas=3)))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0}
    assert fixed["max_ongoing_requests"] == 256
    scaled = model_options_of(parse_config(_config(min_replicas=1, max_replicas=4)))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                            "target_ongoing_requests": 2.0}
    assert fixed["logging_config"] == {"enable_access_log": True}
    ingress = ingress_options(parse_config(_config(ingress_replicas=2,
                                                   ingress_num_cpus=1.0)).serve)
    assert ingress == {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1.0},
                       "max_ongoing_requests": 256,
                       "logging_config": {"enable_access_log": True}}
    quiet = parse_config(_config(access_log=False))
    assert model_options_of(quiet)["logging_config"] == {"enable_access_log": False}
    assert ingress_options(quiet.serve)["logging_config"] == {"enable_access_log": False}
