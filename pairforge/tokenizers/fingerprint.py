"""Digest of a tokenizer fingerprint (no torch: vocab and text code import this)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    """Content digest of a fingerprint, leaving out where the files happened to live.

    Two runs that load the same weights from different paths (a hub id vs a local copy)
    must agree, so ``model`` and ``revision`` are not part of the digest; weights hash,
    preprocessing and sizes are.
    """
    ignored = {"model", "revision", "digest"}
    content = {k: v for k, v in fingerprint.items() if k not in ignored}
    blob = json.dumps(content, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
