"""Captioning backends: a transformers image-to-text model, or an OpenAI-compatible server.

Both turn a batch of images and a prompt (one for all, or one per image: a caption the
checks sent back rides with other rows under its stricter prompt, recaption/rounds.py) into
raw model text; cleaning and the safety checks happen in the recaption step, the same for
every backend. Decoding is greedy by default (a caption has a right answer);
``temperature > 0`` samples.
"""

from __future__ import annotations

import base64
import functools
import io
import os
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
from PIL import Image

from pairforge.config import RecaptionConfig
from pairforge.images import model_dtype
from pairforge.recaption.constrain import WordBlocker
from pairforge.recaption.openai_client import Answer, ChatClient, Failure
from pairforge.recaption.vision import VisionEmbedder

Prompts = str | list[str]  # one prompt for every image, or one per image


def per_image(prompt: Prompts, n: int) -> list[str]:
    """One prompt per image."""
    if isinstance(prompt, str):
        return [prompt] * n
    if len(prompt) != n:
        raise ValueError(f"{len(prompt)} prompts for {n} images")
    return list(prompt)


class Captioner(ABC):
    """Images + prompt -> raw caption text, one per image, in order."""

    # whether several threads may call it at once (a server's client: its requests overlap)
    concurrent = False

    @abstractmethod
    def generate(self, images: list[Image.Image], prompt: Prompts) -> list[str]:
        """The model's answer for each image."""

    def answers(self, images: list[Image.Image], prompt: Prompts) -> list[Answer]:
        """Like ``generate``, but a backend whose requests can fail one by one (a server)
        answers a row it could not caption with a :class:`Failure` instead of raising."""
        return list(self.generate(images, prompt))

    def close(self) -> None:  # noqa: B027 - optional hook, like Step.teardown
        """Release connections and threads; the default holds none."""

    def image_embeddings(self, images: list[Image.Image]) -> np.ndarray:
        """The model's own normalised image vectors, one row per image (the cache's
        embedding tier), where the backend can reach its vision encoder."""
        raise ValueError(f"the {type(self).__name__} backend exposes no vision encoder; set "
                         "recaption.cache.embedding_source: clip")


class TransformersCaptioner(Captioner):
    """Any ``AutoModelForImageTextToText`` model (BLIP, GIT, Florence-2, SmolVLM/Idefics3,
    PaliGemma, Qwen2-VL, ...) with its own processor, by hub id or local folder."""

    def __init__(self, cfg: RecaptionConfig, device: str = "cpu",
                 blocked: list[str] | None = None) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.cfg, self.device = cfg, device
        self.processor = AutoProcessor.from_pretrained(cfg.model, revision=cfg.revision)
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.padding_side = "left"  # batched generation continues every row's end
        dtype = model_dtype(cfg.dtype, device)
        self.model = AutoModelForImageTextToText.from_pretrained(
            cfg.model, revision=cfg.revision, dtype=dtype).to(device).eval()
        self.mode = self._prompt_mode()
        self.image_kwargs, self.generate_kwargs = resolution_kwargs(
            self.processor.image_processor, self.model, cfg.input_resolution)
        # constrained decoding (recaption/constrain.py) in the processor's own subwords
        self.blocker = WordBlocker(tokenizer, blocked) if blocked and tokenizer else None

    @functools.cached_property
    def vision(self) -> VisionEmbedder:
        return VisionEmbedder(self.model, self.processor.image_processor, self.device)

    def image_embeddings(self, images: list[Image.Image]) -> np.ndarray:
        return self.vision.embed(images)

    def _prompt_mode(self) -> str:
        if self.cfg.prompt_mode != "auto":
            return self.cfg.prompt_mode
        return "chat" if getattr(self.processor, "chat_template", None) else "none"

    def _chat_text(self, prompt: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": prompt}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True)

    def _inputs(self, images: list[Image.Image], prompt: Prompts) -> dict[str, Any]:
        prompts = per_image(prompt, len(images))
        if self.mode == "chat":
            texts = {p: self._chat_text(p) for p in dict.fromkeys(prompts)}
            # one image per conversation: nested lists are what multi-image processors want
            return self.processor(text=[texts[p] for p in prompts],
                                  images=[[im] for im in images],
                                  return_tensors="pt", padding=True, **self.image_kwargs)
        if self.mode == "prefix":
            return self.processor(images=images, text=prompts,
                                  return_tensors="pt", padding=True, **self.image_kwargs)
        return self.processor(images=images, return_tensors="pt", **self.image_kwargs)

    def generate(self, images: list[Image.Image], prompt: Prompts) -> list[str]:
        return self.processor.batch_decode(self.generate_ids(images, prompt),
                                           skip_special_tokens=True)

    def generate_ids(self, images: list[Image.Image], prompt: Prompts) -> Any:
        """The generated token ids (a tensor, one row per image), prompt removed."""
        import torch

        inputs = self._inputs(images, prompt).to(self.device)
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        sample = self.cfg.temperature > 0
        extra = {"do_sample": True, "temperature": self.cfg.temperature} if sample else {
            "do_sample": False}
        if self.blocker is not None:
            extra["logits_processor"] = [self.blocker.logits_processor()]
        with torch.inference_mode():
            output = self.model.generate(**inputs, max_new_tokens=self.cfg.max_new_tokens,
                                         **extra, **self.generate_kwargs)
        prompt_ids = inputs.get("input_ids")
        if (prompt_ids is not None and not self.model.config.is_encoder_decoder
                and output.shape[1] >= prompt_ids.shape[1]
                and torch.equal(output[:, :prompt_ids.shape[1]], prompt_ids)):
            output = output[:, prompt_ids.shape[1]:]  # decoder-only: drop the prompt
        return output


def resolution_kwargs(image_processor: Any, model: Any,
                      side: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(processor kwargs, generate kwargs) that make the captioner see ``side`` pixels: a
    fixed-size encoder (BLIP, GIT, PaliGemma: height and width) at side x side with its
    position embeddings interpolated; a tiling one (Idefics3/SmolVLM: longest_edge) with
    that longest edge; a shortest-edge one (CLIP-style) resized and cropped to it."""
    if side is None:
        return {}, {}
    size = image_processor.size
    has = (lambda k: size.get(k) is not None) if isinstance(size, dict) else (
        lambda k: getattr(size, k, None) is not None)
    if has("height") and has("width"):
        import inspect

        takes = "interpolate_pos_encoding" in inspect.signature(model.generate).parameters
        return ({"size": {"height": side, "width": side}},
                {"interpolate_pos_encoding": True} if takes else {})
    if has("longest_edge"):
        return {"size": {"longest_edge": side}}, {}
    if has("shortest_edge"):
        return {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}, {}
    raise ValueError(f"process.recaption.input_resolution: the image processor "
                     f"{type(image_processor).__name__} has no size this setting knows how to "
                     f"change ({size}); leave it null for this model")


def data_url(image: Image.Image) -> str:
    """A base64 JPEG data URL, as chat-completions servers take images."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


class OpenAICaptioner(Captioner):
    """A chat-completions endpoint (vLLM, SGLang, TGI): one request per image,
    ``openai.concurrency`` in flight per captioner across every thread that calls it
    (recaption/openai_client.py), retries with backoff on timeouts, 429 and 5xx (honouring
    Retry-After); a request that still fails is its row's :class:`Failure`."""

    concurrent = True

    def __init__(self, cfg: RecaptionConfig, blocked: list[str] | None = None) -> None:
        self.cfg, self.server = cfg, cfg.openai
        self.logit_bias = _logit_bias(cfg, blocked)
        key = os.environ.get(self.server.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = self.server.base_url.rstrip("/") + "/chat/completions"
        self.client = ChatClient(self.server, self.url, headers)

    def _body(self, image: Image.Image, prompt: str) -> dict[str, Any]:
        side = self.cfg.input_resolution
        if side and max(image.size) > side:  # the server's image tokens follow the size
            image = image.copy()
            image.thumbnail((side, side), Image.Resampling.LANCZOS)
        body = {"model": self.cfg.model, "max_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                    {"type": "text", "text": prompt}]}]}
        if self.logit_bias:
            body["logit_bias"] = self.logit_bias
        return body

    def answers(self, images: list[Image.Image], prompt: Prompts) -> list[Answer]:
        # submitted one by one as encoded: the first requests are in flight while the
        # batch's later images are still being turned into JPEG
        futures = [self.client.submit(self._body(im, p))
                   for im, p in zip(images, per_image(prompt, len(images)), strict=True)]
        return [f.result() for f in futures]

    def generate(self, images: list[Image.Image], prompt: Prompts) -> list[str]:
        answers = self.answers(images, prompt)
        failed = [a for a in answers if isinstance(a, Failure)]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(answers)} requests to {self.url} "
                               f"failed: {failed[0].reason} ({failed[0].detail})")
        return [a for a in answers if isinstance(a, str)]

    def close(self) -> None:
        self.client.close()


def _logit_bias(cfg: RecaptionConfig, blocked: list[str] | None) -> dict[str, int]:
    """The served model's token ids to refuse, from its tokenizer when the config names one
    (a server knows its ids, the client only through the same tokenizer)."""
    if not blocked or not cfg.openai.logit_bias_tokenizer:
        return {}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.openai.logit_bias_tokenizer)
    return WordBlocker(tokenizer, blocked).logit_bias()


def load_captioner(cfg: RecaptionConfig, device: str = "cpu",
                   blocked: list[str] | None = None) -> Captioner:
    """The configured backend; ``blocked`` words are refused at generation time."""
    if cfg.backend == "openai":
        return OpenAICaptioner(cfg, blocked)
    return TransformersCaptioner(cfg, device, blocked)
