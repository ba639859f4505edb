"""Failed captions go into later generate calls with other rows (issue 49 item 3), and a
captioner's generate backs off on out-of-memory (recaption/rounds.py).

Real tiny models (DESIGN.md section 8): SmolVLM's architecture (Idefics3, chat template,
so the strict prompt reaches the model) with random weights, and the golden build's tiny
CLIP for grounding. Grounding's ``min_score`` is out of reach, so a caption that names an
object (here "baseball", from an extra noun file) is sent back for the strict retry:
which rows fail is the model's own doing, not faked. Generate calls are counted by
wrapping the loaded captioner's ``generate``, which still runs the model.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import golden
import pytest
import torch
from conftest import COCO_CAPTIONS, COCO_IMAGES
from PIL import Image
from test_recaption import _coco_captions
from tiny_models import save_tiny_captioner

from pairforge.config import ClipConfig, RecaptionConfig
from pairforge.recaption.backends import TransformersCaptioner
from pairforge.recaption.checked import CheckedCaptioner
from pairforge.recaption.prompts import DEFAULT_PROMPT, STRICT_PROMPT

STRICT = DEFAULT_PROMPT + STRICT_PROMPT
# photos by index in the COCO sample: with this seed, photos 0, 1 and 2 get a first caption
# naming a baseball and 3, 4 and 6 one naming no object (the serial run below asserts it)
BATCH_A = [0, 3, 4, 6]  # one row sent back
BATCH_B = [1, 2, 3, 4]  # two rows sent back
assert COCO_CAPTIONS.exists()


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory) -> Path:
    return save_tiny_captioner("idefics3", tmp_path_factory.mktemp("idefics3") / "model",
                               _coco_captions(), resolution=64)


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> dict:
    return golden.tiny_clip(tmp_path_factory.mktemp("clip"), name="pf-retry-clip")


@pytest.fixture(scope="module")
def config(idefics3, clip, tmp_path_factory) -> tuple[RecaptionConfig, ClipConfig]:
    nouns = tmp_path_factory.mktemp("nouns") / "extra.txt"
    nouns.write_text("baseball\n")
    rc = RecaptionConfig(model=str(idefics3), max_new_tokens=8, batch_size=4,
                         grounding={"enabled": True, "backend": "clip", "min_score": 1.5,
                                    "extra_nouns": [str(nouns)]})
    return rc, ClipConfig(**clip)


def _photos(indices: list[int]) -> list[Image.Image]:
    files = sorted(COCO_IMAGES.glob("*.jpg"))
    return [Image.open(files[i]).convert("RGB") for i in indices]


def _counting(checked: CheckedCaptioner, calls: list[list[str]],
              before_first: threading.Event | None = None) -> None:
    """Record each generate call's prompts; with ``before_first``, the first call waits for
    it (another thread's rows queued behind it)."""
    captioner = checked.captioner
    generate = captioner.generate

    def counted(images: list[Image.Image], prompt: str | list[str]) -> list[str]:
        prompts = [prompt] * len(images) if isinstance(prompt, str) else list(prompt)
        calls.append(prompts)
        if before_first is not None and len(calls) == 1:
            assert before_first.wait(120)
        return generate(images, prompt)

    captioner.generate = counted


def _regenerated(entries) -> int:  # noqa: ANN001
    return sum(any(f.startswith("regenerated:") for f in e.flags) for e in entries)


def test_retries_ride_in_a_later_call_with_another_batchs_rows(config) -> None:
    rc, clip = config
    a, b = _photos(BATCH_A), _photos(BATCH_B)
    serial = CheckedCaptioner(rc, clip, "cpu")
    serial_calls: list[list[str]] = []
    _counting(serial, serial_calls)
    expected_a, expected_b = serial.caption_images(a), serial.caption_images(b)
    # one batch at a time: the retries are a short call after each batch, as before
    assert [len(c) for c in serial_calls] == [4, 1, 4, 2]
    assert (_regenerated(expected_a), _regenerated(expected_b)) == (1, 2)
    assert all(set(c) == {STRICT} for c in (serial_calls[1], serial_calls[3]))

    # two batches in one actor, as the step's two threads hold them
    shared = CheckedCaptioner(rc, clip, "cpu")
    calls: list[list[str]] = []
    queued = threading.Event()
    _counting(shared, calls, queued)
    # the step hands over the clip step's vectors: no CLIP call, so B queues its rows
    # while A's generate holds the model lock
    vectors = {"a": list(shared.clip.embed_images(a)), "b": list(shared.clip.embed_images(b))}
    assert shared.grounding is not None  # loaded before the threads start
    results: dict[str, list] = {}

    def caption(name: str, images: list[Image.Image]) -> None:
        results[name] = shared.caption_images(images, vectors[name])

    first = threading.Thread(target=caption, args=("a", a))
    first.start()
    while not calls:  # batch A's first call has started
        time.sleep(0.01)
    second = threading.Thread(target=caption, args=("b", b))
    second.start()
    deadline = time.monotonic() + 120
    while len(shared.shared.pending) < len(b) and time.monotonic() < deadline:
        time.sleep(0.01)
    queued.set()
    first.join(300)
    second.join(300)

    # every row ends as it did one batch at a time: caption, flags, abstention
    assert results["a"] == expected_a and results["b"] == expected_b
    # A's first try, B's first try, then A's and B's retries in one call
    assert [len(c) for c in calls] == [4, 4, 3]
    assert calls[2] == [STRICT] * 3
    assert len(calls) < len(serial_calls)


def test_a_call_mixes_prompts_and_each_row_keeps_its_text(idefics3) -> None:
    """A first try and a strict retry in one call (left padding, two prompt lengths) give
    each row the text it gets alone: the calls' company does not change a caption."""
    captioner = TransformersCaptioner(RecaptionConfig(model=str(idefics3), max_new_tokens=8))
    images = _photos([0, 1, 2, 3])
    prompts = [DEFAULT_PROMPT, STRICT, STRICT, DEFAULT_PROMPT]
    mixed = captioner.generate(images, prompts)
    assert mixed == [captioner.generate([im], p)[0]
                     for im, p in zip(images, prompts, strict=True)]
    assert mixed[0] != mixed[1] or captioner.generate(images[:1], STRICT) != mixed[0]


def test_generate_out_of_memory_halves_and_loses_no_row(config, monkeypatch) -> None:
    rc, clip = config
    images = _photos(BATCH_A + BATCH_B)
    expected = CheckedCaptioner(rc, clip, "cpu").caption_images(images)
    checked = CheckedCaptioner(rc, clip, "cpu")
    model = checked.captioner.model
    real = type(model).generate
    seen: list[int] = []

    def generate(self, *args, **kwargs):  # noqa: ANN001, ANN202 - the model's signature
        rows = kwargs["input_ids"].shape[0]
        seen.append(rows)
        if rows > 2:  # a card that holds two captions at a time
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", generate)
    assert checked.caption_images(images) == expected
    assert checked.shared.size.rows == 2  # kept for the actor's later calls
    assert seen[0] == 4 and max(seen[1:]) == 2


def test_out_of_memory_at_one_row_is_an_error(config, monkeypatch) -> None:
    rc, clip = config
    checked = CheckedCaptioner(rc, clip, "cpu")
    model = checked.captioner.model

    def generate(self, *args, **kwargs):  # noqa: ANN001, ANN202
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(type(model), "generate", generate)
    with pytest.raises(torch.OutOfMemoryError):
        checked.caption_images(_photos([0, 1, 2]))
