"""The three hashes of DESIGN.md section 3, computed in the download pass."""

from __future__ import annotations

import hashlib

import imagehash
from PIL import Image


def sha256_hex(data: bytes) -> str:
    """sha256 of the downloaded bytes, as img2dataset writes it."""
    return hashlib.sha256(data).hexdigest()


def pixel_hash_hex(image: Image.Image) -> str:
    """Exact hash of decoded RGB pixels and their shape: equal for any lossless re-encode."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def phash_u64(image: Image.Image) -> int:
    """64-bit perceptual hash (imagehash.phash, 8x8 DCT) as an unsigned integer."""
    bits = imagehash.phash(image, hash_size=8).hash.flatten()
    value = 0
    for bit in bits:
        value = (value << 1) | int(bit)
    return value


def hamming_u64(a: int, b: int) -> int:
    return (a ^ b).bit_count()
