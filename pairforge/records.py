"""The record every stage carries (DESIGN.md section 3): status codes and Arrow schemas.

Every input row ends in exactly one shard parquet with exactly one status, so the
funnel (rows per status) always adds up to the input count.
"""

from __future__ import annotations

from enum import StrEnum

import pyarrow as pa


class Status(StrEnum):
    """The closed set of reasons a row is in (``ok``) or left the pipeline."""

    OK = "ok"
    # stage 1: download
    DOWNLOAD_ERROR = "download_error"  # connection refused/reset, DNS failure, bad response
    HTTP_ERROR = "http_error"  # a 4xx/5xx status after retries
    TIMEOUT = "timeout"  # connect or read exceeded download.timeout
    HOST_PAUSED = "host_paused"  # the host's circuit breaker stayed open to the run's end
    TOO_LARGE = "too_large"  # body over max_bytes, or decoded pixels over max_pixels
    NOT_AN_IMAGE = "not_an_image"  # body is not a format Pillow recognises (HTML, text, ...)
    DECODE_ERROR = "decode_error"  # recognised image that fails to decode (truncated, corrupt)
    OPTED_OUT = "opted_out"  # an opt-out: X-Robots-Tag noai/noimageai/..., an opt-out list
    BLOCKED = "blocked"  # the image's hash is on a block list (download.block_lists)
    BLOCKED_ADDRESS = "blocked_address"  # host resolves to a refused address, or refused scheme
    TOO_MANY_REDIRECTS = "too_many_redirects"  # redirect loop or chain past max_redirects
    INVALID_URL = "invalid_url"  # empty, unparsable, or a scheme that is not allowed
    TOO_SMALL = "too_small"  # a side below min_image_size
    BAD_ASPECT = "bad_aspect"  # aspect ratio over max_aspect_ratio
    CAPTION_INVALID = "caption_invalid"  # empty caption or not valid UTF-8
    # stage 2: dedup
    DUPLICATE_EXACT = "duplicate_exact"
    DUPLICATE_NEAR = "duplicate_near"
    DUPLICATE_MIRROR = "duplicate_mirror"
    DUPLICATE_CROP = "duplicate_crop"
    DUPLICATE_SEMANTIC = "duplicate_semantic"  # stage 3's optional CLIP-embedding pass
    # stage 3: process
    CAPTION_TOO_SHORT = "caption_too_short"
    CAPTION_TOO_LONG = "caption_too_long"
    CAPTION_LANGUAGE = "caption_language"
    CAPTION_ABSTAINED = "caption_abstained"  # recaption-first: no caption at all
    LOW_CLIP_SCORE = "low_clip_score"
    UNSAFE = "unsafe"
    LOW_AESTHETIC = "low_aesthetic"
    WATERMARKED = "watermarked"
    CLASSIFIER_REJECTED = "classifier_rejected"


STATUS_HELP: dict[Status, str] = {
    Status.OK: "kept",
    Status.DOWNLOAD_ERROR: "connection failed or the server answered nonsense",
    Status.HTTP_ERROR: "HTTP 4xx/5xx (after retries for 429/5xx)",
    Status.TIMEOUT: "connect or read took longer than download.timeout",
    Status.HOST_PAUSED: "the host failed download.host_failures requests in a row and was "
                        "paused; it had not recovered when the run ended",
    Status.TOO_LARGE: "body over download.max_bytes or image over download.image.max_pixels",
    Status.NOT_AN_IMAGE: "the body is not an image Pillow recognises",
    Status.DECODE_ERROR: "an image that fails to decode (truncated or corrupt; in stage 3, "
                         "a raw shard's image that no longer decodes)",
    Status.OPTED_OUT: "opted out: robots.txt, a TDM reservation (tdm-reservation header or "
                      "tdmrep.json), X-Robots-Tag (noai, noimageai, ...) or an opt-out list "
                      "(download.opt_out_lists); opt_out_reason says which",
    Status.BLOCKED: "its sha256, pixel hash or perceptual hash is on a block list "
                    "(download.block_lists); nothing of it is written",
    Status.BLOCKED_ADDRESS: "host resolves to an address the guard refuses",
    Status.TOO_MANY_REDIRECTS: "redirect loop or more than download.max_redirects hops",
    Status.INVALID_URL: "empty/unparsable URL or a scheme that is not allowed",
    Status.TOO_SMALL: "a side below download.image.min_image_size or process.basic.min_image_side",
    Status.BAD_ASPECT: ("aspect ratio above download.image.max_aspect_ratio or "
                        "process.basic.max_aspect_ratio"),
    Status.CAPTION_INVALID: "caption empty or not valid UTF-8",
    Status.DUPLICATE_EXACT: "identical decoded pixels to a kept sample",
    Status.DUPLICATE_NEAR: "perceptual hash within dedup.max_distance of a kept sample",
    Status.DUPLICATE_MIRROR: "a left-right mirror of a kept sample (mirrored phash within "
                             "dedup.max_distance)",
    Status.DUPLICATE_CROP: "a cropped copy of a kept sample, or it of this one (a centre "
                           "region's phash within dedup.max_distance)",
    Status.DUPLICATE_SEMANTIC: "CLIP image embedding within dedup.semantic.threshold cosine "
                               "of a kept sample",
    Status.CAPTION_TOO_SHORT: "caption has fewer words/characters than the filter allows",
    Status.CAPTION_TOO_LONG: "caption has more words/characters than the filter allows",
    Status.CAPTION_LANGUAGE: "caption language not in the allowed set",
    Status.CAPTION_ABSTAINED: "the captioner abstained on an image without usable alt-text "
                              "(empty, a file name, boilerplate: caption_issue says which)",
    Status.LOW_CLIP_SCORE: "CLIP image-text similarity below the threshold",
    Status.UNSAFE: "an image classifier scored it unsafe (e.g. NSFW; process.classifiers)",
    Status.LOW_AESTHETIC: "an aesthetic classifier scored it below its drop_below",
    Status.WATERMARKED: "a watermark classifier scored it above its drop_above",
    Status.CLASSIFIER_REJECTED: "another process.classifiers entry dropped it (the error "
                                "names the classifier, its score and bound)",
}

# A stage-1 row whose failure may pass, so that `pairforge download --retry-failed` fetches
# it again: a timeout, a host paused by its circuit breaker, HTTP 429 or 5xx, and a
# connection that was refused, reset or cut short (download_error rows whose error names
# one of these; DNS failures, TLS certificate errors and nonsense answers are not retried).
TRANSIENT_STATUSES = frozenset({Status.TIMEOUT, Status.HOST_PAUSED})
TRANSIENT_CONNECTION_ERRORS = ("ConnectionRefusedError", "ConnectionResetError",
                               "ConnectionAbortedError", "BrokenPipeError",
                               "RemoteDisconnected", "IncompleteRead")


def is_transient_failure(status: str, http_status: int | None, error: str | None) -> bool:
    """Whether a raw row's failure is one ``--retry-failed`` fetches again."""
    if status in TRANSIENT_STATUSES:
        return True
    if status == Status.HTTP_ERROR:
        return http_status is not None and (http_status == 429 or http_status >= 500)
    cause = (error or "").removeprefix("bad response: ")  # http.client's, for cut bodies
    return status == Status.DOWNLOAD_ERROR and cause.startswith(TRANSIENT_CONNECTION_ERRORS)

# Columns of a raw (stage 1) shard parquet, before any user columns kept from the input.
RAW_COLUMNS: list[pa.Field] = [
    pa.field("key", pa.string()),
    pa.field("url", pa.string()),
    pa.field("caption", pa.string()),
    # why the alt-text cannot train (download/alt_text.py: absent, empty, not_utf8,
    # file_name, boilerplate), null when it can; absent in shards written before it
    pa.field("caption_issue", pa.string()),
    pa.field("status", pa.string()),
    pa.field("error", pa.string()),
    pa.field("http_status", pa.int32()),
    pa.field("image_format", pa.string()),
    pa.field("width", pa.int32()),
    pa.field("height", pa.int32()),
    pa.field("original_width", pa.int32()),
    pa.field("original_height", pa.int32()),
    pa.field("sha256", pa.string()),
    pa.field("pixel_hash", pa.string()),
    pa.field("phash", pa.uint64()),
    pa.field("phash_mirror", pa.uint64()),  # dedup only: see filters/hashing.py
    pa.field("crop_phashes", pa.list_(pa.uint64())),  # dedup only: centre regions, mirrors
    # dedup only: YCbCr cell means, 8x8 of the whole, 4x4 of each crop region (288 bytes)
    pa.field("colour_grid", pa.binary()),
    pa.field("exif", pa.string()),
    # opted_out rows: robots, tdm, x_robots_tag or list (null otherwise; absent in shards
    # written before it was added, which readers take as null)
    pa.field("opt_out_reason", pa.string()),
]

# Only these are read by the dedup stage; it never opens images.
HASH_COLUMNS = ["key", "status", "sha256", "pixel_hash", "phash", "phash_mirror",
                "crop_phashes", "colour_grid", "original_width", "original_height"]


# Columns stage 3 may add to the raw record, in the order they appear in its parquet. Steps
# declare what they provide by name from here, so every column has one type everywhere.
PROCESS_COLUMNS: dict[str, pa.DataType] = {
    "duplicate_of": pa.string(),  # the kept key, for duplicate_* rows
    "clip_score": pa.float32(),  # the score CLIP judged (filters/clip.py: which caption)
    "clip_score_original": pa.float32(),  # clip.score both: the alt-text's score as well
    "clip_embedding": pa.list_(pa.float32()),  # written to OUT/embeddings, not the parquet
    "recaption": pa.string(),
    "recaption_flags": pa.list_(pa.string()),
    "recaption_origin": pa.string(),  # model, build (another row's) or cache
    "recaption_embedding": pa.list_(pa.float32()),  # the cache's embedding tier, not written
    # recaption.second_prompt: the same four for the second instruction
    "recaption_2": pa.string(),
    "recaption_2_flags": pa.list_(pa.string()),
    "recaption_2_origin": pa.string(),
    "recaption_2_embedding": pa.list_(pa.float32()),
    # recaption-first builds: CLIP's score of each candidate caption (filters/clip.py)
    "clip_score_recaption": pa.float32(),
    "clip_score_recaption_2": pa.float32(),
    "caption_source": pa.string(),  # recaption or original: which caption trains
    "train_caption": pa.string(),  # the one training caption (recaption/choice.py)
    "image_tokens": pa.list_(pa.int32()),
    "token_grid": pa.list_(pa.int32()),
    "n_image_tokens": pa.int32(),
    "caption_tokens": pa.list_(pa.int32()),
    "n_caption_tokens": pa.int32(),
    "task": pa.string(),  # t2i, i2t or img (shards/labels.py), set by the writer
    "vocab_layout": pa.string(),  # the tokenize step's layout (json), into the shard stats
}
# Step outputs written to their own per-shard files rather than the parquet.
PER_SHARD_FILES = {"clip_embedding", "recaption_embedding", "recaption_2_embedding"}
# Step outputs that describe the whole shard: the writer moves them into its stats file.
PER_SHARD_STATS = {"vocab_layout": "vocab"}
# What the steps see of a raw row (plus its image); the writer has the rest.
STEP_INPUT_COLUMNS = ["key", "caption", "caption_issue", "status", "error", "image_format",
                      "width", "height", "original_width", "original_height", "pixel_hash", "phash"]
# The fields of every sample's json in a training tar (DESIGN.md section 4).
SAMPLE_FIELDS = ["key", "url", "caption", "width", "height", "original_width",
                 "original_height", "image_format", "sha256", "pixel_hash", "phash",
                 "clip_score", "recaption", "recaption_flags", "caption_source"]
TOKEN_FIELDS = ["task", "n_image_tokens", "token_grid", "n_caption_tokens"]


# The statuses a process.classifiers entry may give the rows it drops.
CLASSIFIER_STATUSES = (Status.UNSAFE, Status.LOW_AESTHETIC, Status.WATERMARKED,
                       Status.CLASSIFIER_REJECTED)
# A classifier named NAME adds the stage-3 column NAME_score, typed here like the others; it
# goes into the parquet (every row it scored) and the json of every kept sample.
CLASSIFIER_SCORE_TYPE = pa.float32()


def end_rows(batch: pa.Table, ended: dict[int, tuple[str, str | None]]) -> pa.Table:
    """``batch`` with the rows in ``ended`` ({row: (status, error)}) given that status and
    error message; every other row as it was."""
    if not ended:
        return batch
    statuses, errors = batch["status"].to_pylist(), batch["error"].to_pylist()
    for i, (status, error) in ended.items():
        statuses[i], errors[i] = status, error
    batch = batch.set_column(batch.column_names.index("status"), "status",
                             pa.array(statuses, pa.string()))
    return batch.set_column(batch.column_names.index("error"), "error",
                            pa.array(errors, pa.string()))


def classifier_columns(*names: str) -> dict[str, pa.DataType]:
    """The score columns of the named classifiers, for a step's ``provides``."""
    return {f"{name}_score": CLASSIFIER_SCORE_TYPE for name in names}


def reserved_column_names() -> set[str]:
    """Column and json field names a classifier's score column must not take."""
    return ({f.name for f in RAW_COLUMNS} | set(PROCESS_COLUMNS) | set(SAMPLE_FIELDS)
            | set(TOKEN_FIELDS) | {"image", "shard", "train_caption"})


def process_columns(*names: str) -> dict[str, pa.DataType]:
    """The declared types of the named stage-3 columns, for a step's ``provides``."""
    return {name: PROCESS_COLUMNS[name] for name in names}


def process_fields(provided: dict[str, pa.DataType]) -> list[pa.Field]:
    """The columns stage 3 adds to a raw shard's parquet, given what its steps provide (in
    chain order); the same in every shard of a run."""
    columns = {"duplicate_of": PROCESS_COLUMNS["duplicate_of"]}
    columns.update((n, t) for n, t in provided.items()
                   if n not in PER_SHARD_FILES and n not in PER_SHARD_STATS)
    if "n_image_tokens" in provided:
        columns["task"] = PROCESS_COLUMNS["task"]
    return [pa.field(n, t) for n, t in columns.items()]


def raw_schema(extra_columns: list[str] | None = None) -> pa.Schema:
    """Schema of a raw shard parquet; user columns are kept as strings."""
    fields = list(RAW_COLUMNS)
    fields += [pa.field(name, pa.string()) for name in extra_columns or []]
    return pa.schema(fields)


def make_key(shard_id: int, index: int, index_digits: int = 4) -> str:
    """``SSSSSIIII`` digits: shard id then the row's index in its shard, never a dot."""
    return f"{shard_id:05d}{index:0{index_digits}d}"


def shard_of_key(key: str, index_digits: int) -> int:
    """The shard id of a key made by ``make_key`` with ``index_digits``."""
    return int(key[:-index_digits])


def index_digits(shard_size: int) -> int:
    """Digits needed for the in-shard index (at least 4, as img2dataset does)."""
    return max(4, len(str(max(shard_size - 1, 0))))


def json_safe(meta: dict) -> dict:
    """A sample's json metadata: the 64-bit phash as 16 hex digits, since JSON readers
    (JavaScript, Arrow's int64 inference in Hugging Face datasets) cannot hold a uint64."""
    phash = meta.get("phash")
    return {**meta, "phash": f"{phash:016x}"} if isinstance(phash, int) else meta
