"""The train config: one YAML file plus ``--set a.b=c`` overrides, strict like the build config.

Unknown keys are errors naming the key; the YAML reading, the overrides and the error text
are the build config's own helpers (pairforge/config.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from pairforge.config import ConfigError, Strict, _describe, apply_overrides, read_yaml_mapping


class DataConfig(Strict):
    """Which shards to stream and how."""

    path: str | list[str] = Field(
        description="pairforge dataset folder(s) (manifest.json + shards/), local or fsspec")
    heldout_shards: int | list[str] = Field(
        1, description="held out for evaluation: the last N shards of the first dataset, "
        "or shard names such as 00003.tar")
    shuffle_shards: bool = Field(True, description="new shard order every epoch (seeded)")
    shuffle_buffer: int = Field(256, ge=0, description="samples in the shuffle buffer (0: off)")
    resampled: bool | None = Field(
        None, description="draw shards with replacement, an endless stream per rank "
        "(null: on when training on more than one process)")
    epochs: int | None = Field(
        None, gt=0, description="stop after this many passes (single process, not resampled)")
    bucket_batches: int = Field(
        8, gt=0, description="batches per length-sorting buffer (1: no bucketing)")
    storage_options: dict[str, Any] = Field(default_factory=dict)


class ModelConfig(Strict):
    """A decoder-only transformer; the vocabulary comes from the shards' layout."""

    vocab: str | dict[str, Any] | None = Field(
        None, description="the vocabulary the model is built for: null = the first dataset's "
        "layout; a manifest.json or dataset folder; or VocabLayout fields")
    d_model: int = Field(256, gt=0)
    n_layers: int = Field(4, gt=0)
    n_heads: int = Field(4, gt=0)
    mlp_ratio: float = Field(4.0, gt=0)
    max_seq_len: int = Field(512, gt=1, description="longer sequences are refused, not cut")
    dropout: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        return self


class OptimConfig(Strict):
    """AdamW, linear warmup, cosine decay to ``min_lr_ratio * lr``."""

    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(100, ge=0)
    weight_decay: float = Field(0.1, ge=0, description="on matrices only, not norms/biases")
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm (0: off)")


class RunConfig(Strict):
    """The loop: steps, recipe, schedule, logging, checkpoints."""

    out: str = Field("runs/train", description="checkpoint, log and report folder")
    steps: int = Field(1000, gt=0, description="optimizer steps (sets the LR schedule)")
    batch_size: int = Field(32, gt=0, description="sequences per step per process")
    seed: int = 0
    recipe: Literal["replacement", "baseline"] = Field(
        "replacement", description="replacement: shards as labelled; baseline: i2t samples "
        "train as caption-dropped img examples (same image-token budget)")
    schedule: Literal["mixed", "staged"] = Field(
        "mixed", description="mixed: tasks interleaved as in the shards; staged: all "
        "i2t/img samples first, then t2i")
    log_every: int = Field(10, gt=0)
    eval_every: int = Field(0, ge=0, description="held-out evaluation period (0: at the end)")
    eval_batches: int | None = Field(None, gt=0, description="cap on held-out batches")
    checkpoint_every: int = Field(0, ge=0, description="checkpoint period (0: at the end)")
    resume: bool = Field(True, description="continue from OUT/checkpoint.pt when present")
    stop_after: int | None = Field(
        None, gt=0, description="checkpoint and exit after this step, as if interrupted")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on GPU, fp32 on CPU")
    threads: int | None = Field(None, gt=0, description="torch CPU threads per process")


class TrainConfig(Strict):
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    run: RunConfig = Field(default_factory=RunConfig)


def parse_train_config(data: dict[str, Any], overrides: list[str] | None = None) -> TrainConfig:
    data = apply_overrides(dict(data), overrides or [])
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML train config, apply overrides, validate; ConfigError names the key."""
    return parse_train_config(read_yaml_mapping(path), overrides)
