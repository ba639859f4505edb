"""The features of a training sample as Hugging Face ``datasets`` declares them.

``load_dataset("webdataset", ...)`` infers column types from the first samples it reads,
so a first shard whose samples all have ``clip_score: null`` or ``recaption_flags: []``
fixes a null type that a later shard's values cannot be cast to. ``OUT/features.json``
states every type up front (``datasets.Features.to_dict()`` layout); pass it as
``features=datasets.Features.from_dict(...)`` (README, "Output").

The json fields follow one rule in every sample: all of ``SAMPLE_FIELDS`` (and, when
tokenized, ``TOKEN_FIELDS``) are present; a value that is unknown for a sample (no CLIP
score, no recaption) is null, and a list is a list of its declared type even when empty.
"""

from __future__ import annotations

from typing import Any

from pairforge.records import SAMPLE_FIELDS, TOKEN_FIELDS


def _value(dtype: str) -> dict[str, Any]:
    return {"dtype": dtype, "_type": "Value"}


def _list(feature: dict[str, Any]) -> dict[str, Any]:
    return {"feature": feature, "_type": "List"}


JSON_TYPES: dict[str, dict[str, Any]] = {
    **{f: _value("string") for f in ("key", "url", "caption", "image_format", "sha256",
                                      "pixel_hash", "phash", "recaption", "caption_source",
                                      "task")},
    **{f: _value("int64") for f in ("width", "height", "original_width", "original_height",
                                     "n_image_tokens", "n_caption_tokens")},
    "clip_score": _value("float64"),
    "recaption_flags": _list(_value("string")),
    "token_grid": _list(_value("int64")),
}


def hf_features(image_extension: str, tokenized: bool,
                scores: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """``datasets.Features.to_dict()`` of the samples of a training shard; ``scores``: the
    classifiers' score fields (``NAME_score``, a float in every kept sample)."""
    fields = SAMPLE_FIELDS + list(scores) + (TOKEN_FIELDS if tokenized else [])
    types = {**JSON_TYPES, **{f: _value("float64") for f in scores}}
    features = {image_extension: {"_type": "Image"}, "txt": _value("string"),
                "json": {f: types[f] for f in fields},
                "__key__": _value("string"), "__url__": _value("string")}
    if tokenized:
        features["vq.npy"] = _list(_list(_value("int32")))
        features["tok.npy"] = _list(_value("int32"))
    return features
