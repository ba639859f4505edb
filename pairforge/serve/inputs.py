"""What a caption request carries, checked: the image bytes, from any of the accepted forms.

``POST /v1/captions`` takes the image as the raw body (an ``image/*`` Content-Type), as
the first file part of a ``multipart/form-data`` body, or as JSON ``{"image_base64"}`` or
``{"url"}``. A URL goes through stage 1's guarded fetcher (download/fetch.py: the address
guard, the body cap, a deadline per request); the bytes, wherever they came from, go
through stage 1's image pass (download/imageproc.py: format check, decompression-bomb
cap, the cache's hashes, the download section's resize and encode), so an upload reaches
the captioner as the same pixels a build would caption for the same image. Every refusal
is a ``RequestError``: an HTTP status, a short machine-readable kind and a sentence.
"""

from __future__ import annotations

import base64
import binascii
import json
from email.parser import BytesParser
from email.policy import HTTP

from pairforge.config import DownloadConfig, PairforgeConfig
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


def parse_body(content_type: str | None, body: bytes) -> bytes | str:
    """The image bytes in ``body``, or the URL a JSON body names."""
    kind = media_type(content_type)
    if kind.startswith("image/") or kind == "application/octet-stream":
        return _non_empty(body)
    if kind == "multipart/form-data":
        return _multipart_file(content_type or "", body)
    if kind == "application/json":
        return _json_image(body)
    raise RequestError(415, "unsupported_media_type",
                       f"Content-Type {kind or '(none)'} is not accepted; send {FORMS}")


def _non_empty(data: bytes) -> bytes:
    if not data:
        raise RequestError(400, "empty_image", "the image is empty (0 bytes)")
    return data


def _multipart_file(content_type: str, body: bytes) -> bytes:
    """The first part that carries a file (or is named ``image``/``file``)."""
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart() or message.defects:
        raise RequestError(400, "malformed_multipart",
                           "the multipart body could not be parsed (boundary missing or "
                           "wrong)")
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if part.get_filename() is not None or name in ("image", "file"):
            return _non_empty(part.get_payload(decode=True) or b"")
    raise RequestError(400, "no_image_part",
                       "the multipart body has no file part (name it image or file)")


def _json_image(body: bytes) -> bytes | str:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, "malformed_json", f"the body is not valid JSON ({err})") \
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


def url_fetcher(cfg: PairforgeConfig) -> Fetcher:
    """Stage 1's guarded fetcher with the service's deadline and body cap; never file:
    URLs (a caller must not make the service read its own disk), no retries (a
    client waits)."""
    download: DownloadConfig = cfg.download.model_copy(update={
        "timeout": cfg.serve.url_timeout_s, "retries": 0, "allow_file_scheme": False,
        "max_bytes": cfg.serve.max_body_bytes, "respect_robots": False})
    return Fetcher(download)


# fetch statuses that get their own HTTP status; the rest are 422
_FETCH_HTTP = {Status.BLOCKED_ADDRESS: 403, Status.TOO_LARGE: 413, Status.INVALID_URL: 400}


def fetch_image(fetcher: Fetcher, url: str) -> bytes:
    """The body at ``url``, or the fetcher's refusal as a ``RequestError`` (url_*)."""
    result = fetcher.fetch(url)
    if result.status == Status.OK and result.body is not None:
        return _non_empty(result.body)
    raise RequestError(_FETCH_HTTP.get(result.status, 422), f"url_{result.status.value}",
                       f"fetching the URL failed: {result.error}")


# image-pass statuses: a pixel bomb is "too large" (413); the rest cannot be captioned (422)
_IMAGE_HTTP = {Status.TOO_LARGE: 413}
_IMAGE_KIND = {Status.TOO_LARGE: "image_too_large"}


def decode_upload(data: bytes, cfg: PairforgeConfig) -> Upload:
    """Stage 1's image pass over ``data`` with the service's pixel cap: the pixels the
    recaption step would read from a raw shard, the pixel hash, and the perceptual hash
    when the cache's perceptual tier is on (``imageproc.caption_pixels``)."""
    image_cfg = cfg.download.image.model_copy(update={"max_pixels": cfg.serve.max_image_pixels})
    pixels = caption_pixels(data, image_cfg, with_phash=cfg.serve.cache.phash_distance > 0)
    if isinstance(pixels, ImageFailure):
        status = pixels.status
        raise RequestError(_IMAGE_HTTP.get(status, 422), _IMAGE_KIND.get(status, status.value),
                           pixels.error)
    return pixels
