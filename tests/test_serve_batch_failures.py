"""One upload the captioning server fails does not fail the others merged into its batch:
the service's replica (serve/captioning.py) answers each upload, caches only the captions
it got, and the ingress (serve/app.py, ``answered``) turns only the failed upload into a
503 with Retry-After. The server is a real OpenAI-compatible one on 127.0.0.1
(tests/openai_server.py) that answers 500 for red images."""

from __future__ import annotations

import io

import pytest
from openai_server import OpenAIServer
from PIL import Image

from pairforge.config import ClipConfig, ImageConfig, RecaptionConfig, ServeConfig
from pairforge.serve.app import RETRY_AFTER_S, answered
from pairforge.serve.captioning import ReplicaCaptioner
from pairforge.serve.inputs import RequestError, decode_upload

CAPTION = "A small square."
COLOURS = [(20, 120, 220), (250, 10, 10), (10, 200, 60), (20, 120, 220)]  # red fails


def _png(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (48, 48), colour).save(out, "PNG")
    return out.getvalue()


def _red(image: Image.Image) -> bool:
    r, g, b = image.getpixel((0, 0))
    return r > 200 and g < 60


def test_a_failed_upload_fails_alone_and_is_not_cached():
    serve = ServeConfig()
    uploads = [decode_upload(_png(c), serve, ImageConfig()) for c in COLOURS]
    with OpenAIServer(["served"], text=CAPTION, refuse=_red) as server:
        rc = RecaptionConfig(enabled=True, backend="openai", model="served",
                             constrained_decoding=False, grounding={"enabled": False},
                             openai={"base_url": server.base_url, "retries": 0})
        replica = ReplicaCaptioner(rc, ClipConfig(), serve.cache)
        replica.load()
        answers = replica.caption(uploads)
        again = replica.caption(uploads[1:3])
        replica.checked.close()
        # the blue upload twice in one batch is asked once; the red one every time
        assert server.completions == 3 + 1
    assert [a.entry.recaption for a in answers] == [CAPTION, None, CAPTION, CAPTION]
    assert [a.cache for a in again] == ["miss", "exact"]
    assert len(replica.cache) == 2  # the blue and the green caption, not the failure
    for answer in (answers[0], answers[2], answers[3]):
        assert answered(answer) is answer
    with pytest.raises(RequestError) as refused:
        answered(answers[1])
    assert refused.value.status == 503 and refused.value.kind == "backend_unavailable"
    assert "failed:http_500" in refused.value.message
    assert refused.value.headers == {"Retry-After": str(RETRY_AFTER_S)}
