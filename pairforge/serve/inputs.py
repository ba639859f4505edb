"""What a caption request carries, checked: the image bytes, from any of the accepted forms.

``POST /v1/captions`` takes the image as the raw body (an ``image/*`` Content-Type), as
the first file part of a ``multipart/form-data`` body, or as JSON ``{"image_base64"}`` or
``{"url"}``. A URL goes through stage 1's guarded fetcher (download/fetch.py: the address
guard with ``serve.allow_addresses``, the body cap, a deadline per request); the bytes,
wherever they came from, go through stage 1's image pass (download/imageproc.py: format
check, decompression-bomb cap, the cache's hashes, the download section's resize and
encode), so an upload reaches the captioner as the same pixels a build would caption for
the same image. Every refusal is a ``RequestError``: an HTTP status, a short
machine-readable kind and a sentence.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from PIL import Image
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from pairforge.config import DownloadConfig, ImageConfig, ServeConfig
from pairforge.download.fetch import Fetcher
from pairforge.download.imageproc import CaptionPixels, ImageFailure, caption_pixels
from pairforge.records import Status

FORMS = "an image/* body, multipart/form-data with a file, or JSON {\"url\"} / {\"image_base64\"}"


class RequestError(Exception):
    """A request the service refuses: ``status`` is the HTTP status, ``kind`` names the
    problem in the JSON answer (``{"error": kind, "detail": message}``)."""

    def __init__(self, status: int, kind: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.headers = headers or {}


# an image ready to caption, with the keys the cache looks it up by (phash None: the
# cache's perceptual tier is off)
Upload = CaptionPixels


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def parse_body(content_type: str | None, body: bytes, max_parts: int) -> bytes | str:
    """The image bytes in ``body``, or the URL a JSON body names. Runs on the ingress's
    decode threads: parsing a large body must not hold the event loop (a 6.6 MB multipart
    body of tiny parts took ``email``'s parser 27 s, and every request waited)."""
    kind = media_type(content_type)
    if kind.startswith("image/") or kind == "application/octet-stream":
        return _non_empty(body)
    if kind == "multipart/form-data":
        return _multipart_file(content_type or "", body, max_parts)
    if kind == "application/json":
        return _json_image(body)
    raise RequestError(415, "unsupported_media_type",
                       f"Content-Type {kind or '(none)'} is not accepted; send {FORMS}")


def _non_empty(data: bytes) -> bytes:
    if not data:
        raise RequestError(400, "empty_image", "the image is empty (0 bytes)")
    return data


def _malformed_multipart() -> RequestError:
    return RequestError(400, "malformed_multipart", "the multipart body could not be parsed "
                        "(boundary missing or wrong)")
_CHUNK = 64 * 1024  # what the parser is fed at a time: it stops at the image part's end


class _FilePart:
    """python-multipart's callbacks: the first part that carries a file (or is named
    ``image``/``file``), refusing a body of more than ``max_parts`` parts as it goes."""

    def __init__(self, max_parts: int) -> None:
        self.max_parts, self.parts = max_parts, 0
        self.header, self.headers = b"", {}  # type: tuple[bytes, dict[bytes, bytes]]
        self.field, self.value = bytearray(), bytearray()
        self.data: bytearray | None = None  # the file part's bytes, once it is the one
        self.done = False

    def callbacks(self) -> dict[str, Any]:
        return {"on_part_begin": self.begin, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished,
                "on_part_data": self.part_data, "on_part_end": self.part_end}

    def begin(self) -> None:
        if self.done:  # the rest of the chunk that held the file part's end
            return
        self.parts += 1
        if self.parts > self.max_parts:
            raise RequestError(400, "too_many_parts", "the multipart body has more than "
                               f"serve.max_multipart_parts={self.max_parts} parts")
        self.headers = {}

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self.field += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def header_end(self) -> None:
        self.headers[bytes(self.field).lower()] = bytes(self.value)
        self.field, self.value = bytearray(), bytearray()

    def headers_finished(self) -> None:
        if self.done:
            return
        _, params = parse_options_header(self.headers.get(b"content-disposition", b""))
        if b"filename" in params or params.get(b"name") in (b"image", b"file"):
            self.data = bytearray()

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self.data is not None and not self.done:
            self.data += data[start:end]

    def part_end(self) -> None:
        self.done = self.data is not None


def _multipart_file(content_type: str, body: bytes, max_parts: int) -> bytes:
    """The first file part of a multipart body, by python-multipart's streaming parser,
    fed a chunk at a time until that part ends (the parts after it are never parsed)."""
    _, params = parse_options_header(content_type)
    if not params.get(b"boundary"):
        raise _malformed_multipart()
    found = _FilePart(max_parts)
    parser = MultipartParser(params[b"boundary"], found.callbacks())
    try:
        for at in range(0, len(body), _CHUNK):
            parser.write(body[at:at + _CHUNK])
            if found.done:
                return _non_empty(bytes(found.data or b""))
        parser.finalize()
    except MultipartParseError:
        raise _malformed_multipart() from None
    if found.parts == 0:
        raise _malformed_multipart()
    raise RequestError(400, "no_image_part",
                       "the multipart body has no file part (name it image or file)")


def _json_image(body: bytes) -> bytes | str:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, "malformed_json", f"the body is not valid JSON ({err})") \
            from None
    except RecursionError:  # nested past the decoder's depth: a 400, not a 500
        raise RequestError(400, "malformed_json", "the JSON body is nested too deeply") \
            from None
    if not isinstance(data, dict) or not ({"url", "image_base64"} & data.keys()):
        raise RequestError(400, "malformed_json",
                           'the JSON body needs "url" or "image_base64"')
    if "url" in data:
        if not isinstance(data["url"], str) or not data["url"].strip():
            raise RequestError(400, "invalid_url", '"url" must be a non-empty string')
        return data["url"].strip()
    try:
        return _non_empty(base64.b64decode(data["image_base64"], validate=True))
    except (binascii.Error, TypeError, ValueError):
        raise RequestError(400, "malformed_base64",
                           '"image_base64" is not valid base64') from None


def url_fetcher(serve: ServeConfig, download: DownloadConfig) -> Fetcher:
    """Stage 1's guarded fetcher with the service's deadline, body cap and address
    allow-list (``serve.allow_addresses``, empty by default: the service never reaches
    loopback or private addresses because a build's config lets stage 1 do so); never
    file: URLs (a caller must not make the service read its own disk), no retries (a
    client waits)."""
    return Fetcher(download.model_copy(update={
        "timeout": serve.url_timeout_s, "retries": 0, "allow_file_scheme": False,
        "max_bytes": serve.max_body_bytes, "respect_robots": False,
        "allow_addresses": list(serve.allow_addresses)}))


# fetch statuses that get their own HTTP status and say why; every other failure (refused,
# reset, timed out, an error status, a DNS failure) is one kind with one sentence, so a
# caller cannot tell an open port from a closed one by the answer
_FETCH_HTTP = {Status.BLOCKED_ADDRESS: 403, Status.TOO_LARGE: 413, Status.INVALID_URL: 400,
               Status.TOO_MANY_REDIRECTS: 422}
UNREACHABLE = "url_unreachable"


def unreachable() -> RequestError:
    return RequestError(422, UNREACHABLE, "the URL could not be fetched (no answer, a "
                        "refused or failed connection, or an error status)")


def fetch_image(fetcher: Fetcher, url: str) -> bytes:
    """The body at ``url``, or the fetcher's refusal as a ``RequestError`` (url_*)."""
    result = fetcher.fetch(url)
    if result.status == Status.OK and result.body is not None:
        return _non_empty(result.body)
    if result.status not in _FETCH_HTTP:
        raise unreachable()
    raise RequestError(_FETCH_HTTP[result.status], f"url_{result.status.value}",
                       f"fetching the URL failed: {result.error}")


def raise_pillow_cap(max_pixels: int) -> None:
    """Pillow's own decompression-bomb cap set to ``serve.max_image_pixels``, so the
    service's cap is the one that applies (Pillow refuses past 2x its ``MAX_IMAGE_PIXELS``,
    179 M pixels by default, before the image pass checks ours: a higher
    ``serve.max_image_pixels`` was silently capped at Pillow's). Pillow's refusal stays, at
    twice ours, as a backstop (``decode_upload`` words it with ours). Called in the ingress
    replica's process, which decodes nothing else."""
    Image.MAX_IMAGE_PIXELS = max_pixels


_PILLOW_BOMB = re.compile(r"Image size \((\d+) pixels\) exceeds limit")


# image-pass statuses: a pixel bomb is "too large" (413); the rest cannot be captioned (422)
_IMAGE_HTTP = {Status.TOO_LARGE: 413}
_IMAGE_KIND = {Status.TOO_LARGE: "image_too_large"}


def decode_upload(data: bytes, serve: ServeConfig, image: ImageConfig) -> Upload:
    """Stage 1's image pass (``image``: download.image) over ``data`` with the service's
    pixel cap: the pixels the recaption step would read from a raw shard, the pixel hash,
    and the perceptual hash when the cache's perceptual tier is on
    (``imageproc.caption_pixels``)."""
    image_cfg = image.model_copy(update={"max_pixels": serve.max_image_pixels})
    pixels = caption_pixels(data, image_cfg, with_phash=serve.cache.phash_distance > 0)
    if isinstance(pixels, ImageFailure):
        status, error = pixels.status, pixels.error
        bomb = _PILLOW_BOMB.search(error)
        if bomb:  # Pillow's backstop (raise_pillow_cap): the cap it names is not ours
            error = f"{bomb.group(1)} pixels is over max_pixels={serve.max_image_pixels}"
        raise RequestError(_IMAGE_HTTP.get(status, 422), _IMAGE_KIND.get(status, status.value),
                           error)
    return pixels
