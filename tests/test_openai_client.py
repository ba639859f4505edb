"""The OpenAI-compatible client keeps ``openai.concurrency`` requests in flight across
batches, and a server that fails ends each row with a clear status instead of losing it.

Every server here listens on 127.0.0.1 (tests/openai_server.py). In-flight counts are
measured at the server; the server holds each request until the expected number is in
flight at once, so reaching it does not depend on timing (falling short costs ``hold_s``
per request and fails the count).
"""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from openai_server import OpenAIServer
from PIL import Image

from pairforge.config import ClipConfig, RecaptionConfig, parse_config
from pairforge.recaption.backends import OpenAICaptioner
from pairforge.recaption.cache import CachedCaption
from pairforge.recaption.checked import CheckedCaptioner
from pairforge.recaption.openai_client import (
    Failure,
    ServerRefused,
    batches_in_flight,
    reply_text,
)
from pairforge.recaption.prompts import DEFAULT_PROMPT

CAPTION = "A red ball on the grass."


def _images(n: int) -> list[Image.Image]:
    return [Image.new("RGB", (24, 24), (10 * i, 100, 200)) for i in range(n)]


def _recaption(server: OpenAIServer, **openai: object) -> RecaptionConfig:
    return RecaptionConfig(enabled=True, backend="openai", model="served",
                           constrained_decoding=False, grounding={"enabled": False},
                           openai={"base_url": server.base_url, "retries": 1, **openai})


def test_two_batches_share_the_slots_exactly() -> None:
    """Two threads, three images each, concurrency 4: the server sees exactly 4 at once
    (the batches' requests overlap; never more than the slots)."""
    with OpenAIServer(["served"], text=CAPTION, hold_until=4) as server:
        client = OpenAICaptioner(_recaption(server, concurrency=4))
        answers: list[list] = [[], []]
        threads = [threading.Thread(target=lambda i=i: answers[i].extend(
            client.answers(_images(3), "Describe."))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        client.close()
    assert server.max_in_flight == 4
    assert server.completions == 6
    assert answers == [[CAPTION] * 3, [CAPTION] * 3]


@pytest.mark.parametrize(("server_kwargs", "flag", "asked"), [
    ({"answer_status": 500}, "failed:http_500", 2),  # retried once (retries: 1), then given up
    ({"garbage": True}, "failed:bad_response", 1),  # a 200 that is not a completion: no retry
    ({"answer_status": 400}, "failed:http_400", 1),  # the server refuses this one request
])
def test_a_failing_server_ends_every_row_with_its_status(server_kwargs, flag, asked) -> None:
    with OpenAIServer(["served"], text=CAPTION, **server_kwargs) as server:
        checked = CheckedCaptioner(_recaption(server, concurrency=2), ClipConfig(), "cpu")
        results = checked.caption_images(_images(3))
        checked.close()
        # no strict retry: the server failed, not the caption
        assert server.completions == 3 * asked
    assert results == [CachedCaption(None, (flag,))] * 3


def test_a_timeout_is_the_rows_status() -> None:
    with OpenAIServer(["served"], text=CAPTION, hold_until=99, hold_s=3) as server:
        client = OpenAICaptioner(_recaption(server, timeout_s=0.3, retries=0))
        [answer] = client.answers(_images(1), "Describe.")
        client.close()
    assert isinstance(answer, Failure) and answer.reason == "timeout"


def test_a_wrong_model_name_stops_with_a_clear_error() -> None:
    """404 (likewise 401, 403) would fail every row alike: a configuration error, raised."""
    with OpenAIServer(["served"], text=CAPTION) as server:
        cfg = _recaption(server)
        cfg.model = "other"
        client = OpenAICaptioner(cfg)
        with pytest.raises(ServerRefused, match="HTTP 404"):
            client.answers(_images(2), "Describe.")
        client.close()


def test_reply_text_reads_only_a_completion() -> None:
    assert reply_text(b'{"choices": [{"message": {"content": "a dog"}}]}') == "a dog"
    assert reply_text(b'{"choices": [{"message": {"content": null}}]}') == ""
    assert reply_text(b'{"choices": []}') is None
    assert reply_text(b'{"choices": [{"message": {"content": 3}}]}') is None
    assert reply_text(b"<html>oops</html>") is None


def test_batches_in_flight_cover_the_slots() -> None:
    assert batches_in_flight(32, 8) == 32
    assert batches_in_flight(8, 8) == 8
    assert batches_in_flight(4, 64) == 2  # never fewer than two: one drains, one fills
    assert batches_in_flight(1024, 1) == 128  # the cap


# -- through Ray Data: one actor, two batches at once -------------------------------------

def _rows(keys: list[str]) -> pa.Table:
    images = []
    for i, _ in enumerate(keys):
        buffer = io.BytesIO()
        Image.new("RGB", (24, 24), (40 * i % 255, 90, 160)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return pa.table({"key": keys, "status": ["ok"] * len(keys), "caption": ["alt"] * len(keys),
                     "image": images, "pixel_hash": [f"h{k}" for k in keys],
                     "phash": pa.array([i for i, _ in enumerate(keys)], pa.uint64())})


def _run_step(tmp_path: Path, server: OpenAIServer, concurrency: int,
              batch_size: int) -> list[dict]:
    import ray

    from pairforge.pipeline.contract import step_config
    from pairforge.pipeline.placement import add_step
    from pairforge.recaption.step import RecaptionStep

    cfg = parse_config({"input": {"path": "unused"}, "output": {"path": str(tmp_path)},
                        "dedup": {"enabled": True},  # no claim registry to start
                        "process": {"recaption": {
                            "enabled": True, "backend": "openai", "model": "served",
                            "batch_size": batch_size, "pool_size": 1, "num_cpus": 0.25,
                            "constrained_decoding": False, "cache": {"enabled": False},
                            "grounding": {"enabled": False},
                            "openai": {"base_url": server.base_url, "retries": 1,
                                       "concurrency": concurrency}}}})
    blocks = [_rows([f"{b}-{i}" for i in range(batch_size)]) for b in range(2)]
    ds = add_step(ray.data.from_arrow(blocks), RecaptionStep, step_config(cfg))
    return sorted(ds.take_all(), key=lambda r: r["key"])


def test_one_actor_keeps_concurrency_in_flight_across_two_batches(
        tmp_path, ray_local) -> None:
    """Batches of 3 and concurrency 4: only an actor working on both batches at once puts
    4 requests in flight (one batch at a time reaches 3, and waits hold_s per request)."""
    with OpenAIServer(["served"], text=CAPTION, hold_until=4) as server:
        rows = _run_step(tmp_path, server, concurrency=4, batch_size=3)
    assert server.max_in_flight == 4
    assert server.completions == 6
    assert [r["recaption"] for r in rows] == [CAPTION] * 6
    assert [r["recaption_origin"] for r in rows] == ["model"] * 6
    assert server.prompts == {DEFAULT_PROMPT: 6}


def test_a_server_error_is_each_rows_status_in_the_pipeline(tmp_path, ray_local) -> None:
    with OpenAIServer(["served"], answer_status=503) as server:
        rows = _run_step(tmp_path, server, concurrency=2, batch_size=3)
        assert server.completions == 12  # six rows, each retried once
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    assert [(r["recaption"], r["recaption_origin"], r["recaption_flags"]) for r in rows] == [
        (None, "failed", ["failed:http_503"])] * 6
