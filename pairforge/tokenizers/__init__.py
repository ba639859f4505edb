"""VQ image tokenizers, text tokenizers, and the shared vocabulary layout.

Names are imported lazily so that reading a manifest's vocabulary layout (vocab.py) does
not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ImageTokenizer": "base",
    "TextTokenizer": "text",
    "ByteTokenizer": "text",
    "HFTextTokenizer": "text",
    "train_bpe": "text",
    "VocabLayout": "vocab",
    "VocabMismatch": "vocab",
    "ImageTokenizerSpec": "registry",
    "TextTokenizerSpec": "registry",
    "load_image_tokenizer": "registry",
    "load_text_tokenizer": "registry",
    "train_vq": "train_vq",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
