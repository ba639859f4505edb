"""One place the process stage and the trainer get their tokenizers from.

Specs are small pydantic models (or plain dicts with the same keys, e.g. from YAML):

    image: {backend: pairforge-vq | emu3 | janus | chameleon, path_or_id: ..., device: cpu}
    text:  {backend: hf | bytes, path_or_id: ...}
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from pairforge.tokenizers.base import ImageTokenizer
from pairforge.tokenizers.text import ByteTokenizer, HFTextTokenizer, TextTokenizer

ImageBackend = Literal["pairforge-vq", "emu3", "janus", "chameleon"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ImageTokenizerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: ImageBackend = "pairforge-vq"
    path_or_id: str = Field(description="hub id or local folder (train-vq output for ours)")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    compile: bool = Field(False, description="torch.compile the encoder (ours)")
    batch_size: int = Field(16, gt=0, description="images per forward pass")
    resolution: int | None = Field(
        None, gt=0, description="transformers backends only: override the checkpoint's input "
        "size (emu3: area of about resolution^2; janus/chameleon: side)")
    revision: str | None = Field(None, description="hub revision (transformers backends)")


class TextTokenizerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["hf", "bytes"] = "bytes"
    path_or_id: str | None = Field(None, description="hub id or local folder (train-text output)")
    revision: str | None = None


def _dtype(spec: ImageTokenizerSpec) -> torch.dtype:
    """``auto``: bfloat16 on a GPU, float32 on CPU."""
    if spec.dtype == "auto":
        return torch.bfloat16 if spec.device.startswith("cuda") else torch.float32
    return DTYPES[spec.dtype]


def load_image_tokenizer(spec: ImageTokenizerSpec | dict[str, Any]) -> ImageTokenizer:
    """Build the image tokenizer a spec names."""
    spec = ImageTokenizerSpec.model_validate(spec)
    if spec.backend == "pairforge-vq":
        if spec.resolution is not None:
            raise ValueError("pairforge-vq checkpoints have a fixed resolution; drop 'resolution'")
        from pairforge.tokenizers.vq_tokenizer import PairforgeVQTokenizer

        return PairforgeVQTokenizer(spec.path_or_id, device=spec.device,
                                    batch_size=spec.batch_size, dtype=_dtype(spec),
                                    compile=spec.compile)
    from pairforge.tokenizers.hf_vq import HFVQTokenizer

    return HFVQTokenizer(spec.backend, spec.path_or_id, device=spec.device,
                         dtype=_dtype(spec), batch_size=spec.batch_size,
                         resolution=spec.resolution, revision=spec.revision)


def load_text_tokenizer(spec: TextTokenizerSpec | dict[str, Any] | None = None) -> TextTokenizer:
    """Build the text tokenizer a spec names (no spec: the byte fallback)."""
    spec = TextTokenizerSpec.model_validate(spec or {})
    if spec.backend == "bytes":
        return ByteTokenizer()
    if not spec.path_or_id:
        raise ValueError("text tokenizer backend 'hf' needs path_or_id (hub id or folder)")
    return HFTextTokenizer(spec.path_or_id, revision=spec.revision)
