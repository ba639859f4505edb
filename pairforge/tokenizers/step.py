"""The tokenize step of stage 3: VQ image codes and caption tokens for every ok row.

Each actor loads the image and text tokenizers once (pairforge/tokenizers/registry.py);
the writer turns the columns into ``KEY.vq.npy`` (codes shaped by ``token_grid``) and
``KEY.tok.npy`` (caption ids), and the counts go into each sample's json.
"""

from __future__ import annotations

import json

import pyarrow as pa

from pairforge.config import ModelPoolConfig
from pairforge.images import RGB, ImageView, model_device, square_view, view_images
from pairforge.records import process_columns
from pairforge.sources import TOKENIZER_FILES, WEIGHT_FILES, ModelFolder, ModelSource
from pairforge.stage import ModelStep, Requirements, StepConfig, StepResult, setting_values
from pairforge.tokenizers.vocab import VocabLayout


class TokenizeStep(ModelStep):
    name = "tokenize"
    requires = ("image", "train_caption")
    provides = process_columns("image_tokens", "token_grid", "n_image_tokens",
                               "caption_tokens", "n_caption_tokens", "vocab_layout")

    @classmethod
    def pool_config(cls, cfg: StepConfig) -> ModelPoolConfig:
        return cfg.process.tokenize

    @classmethod
    def enabled(cls, cfg: StepConfig) -> bool:
        return cfg.process.tokenize.enabled

    @classmethod
    def requirements(cls, cfg: StepConfig) -> Requirements:
        tok = cfg.process.tokenize
        return Requirements(display=tok.image.path_or_id if tok.image else None,
                            sources=tokenizer_sources(cfg),
                            settings=setting_values(tok, "process.tokenize."))

    def __init__(self, cfg: StepConfig) -> None:
        from pairforge.tokenizers.registry import load_image_tokenizer, load_text_tokenizer

        super().__init__(cfg)
        tok = cfg.process.tokenize
        self.image_tokenizer = load_image_tokenizer({
            **tok.image.model_dump(), "device": model_device(tok), "batch_size": tok.call_rows,
            "compile": tok.compile})
        self.text_tokenizer = load_text_tokenizer(tok.text.model_dump())
        self.view = (square_view(self.image_tokenizer.resolution)
                     if tok.image.backend == "pairforge-vq" else RGB)
        # the layout travels with the results (on each shard's first row in a batch) into
        # every shard's stats: the manifest is built from those, without loading a model on
        # the driver
        self.layout = json.dumps(VocabLayout.from_tokenizers(
            self.text_tokenizer, self.image_tokenizer).to_manifest(), sort_keys=True)

    @classmethod
    def image_views(cls, cfg: StepConfig) -> tuple[ImageView, ...]:
        """Our VQ's square at its resolution (read from the checkpoint's config.json); a
        transformers VQ's processor takes the decoded image."""
        tok = cfg.process.tokenize
        if tok.image is None or tok.image.backend != "pairforge-vq":
            return (RGB,)
        try:
            return (square_view(int(vqvae_config(tok.image.path_or_id)["resolution"])),)
        except (OSError, ValueError, KeyError):
            return ()  # preflight says what is wrong with the folder; the step decodes itself

    def process(self, rows: pa.Table) -> StepResult:
        images = view_images(rows, self.view)
        grids = self.image_tokenizer.encode(images)
        captions = [self.text_tokenizer.encode(c) if c else [] for c in
                    rows["train_caption"].to_pylist()]
        return StepResult(columns={
            "image_tokens": [g.reshape(-1).tolist() for g in grids],
            "token_grid": [list(g.shape) for g in grids],
            "n_image_tokens": [int(g.size) for g in grids],
            "caption_tokens": captions,
            "n_caption_tokens": [len(c) for c in captions],
            "vocab_layout": [self.layout if first else None for first in _shard_starts(rows)],
        })


def vqvae_config(path: str) -> dict:
    from pairforge.tokenizers.vqvae import read_config  # imports torch

    return read_config(path)


def tokenizer_sources(cfg: StepConfig) -> tuple[ModelSource, ...]:
    """The image tokenizer (ours: a train-vq folder, never a hub id; the others: a
    transformers folder or hub id) and an hf text tokenizer."""
    tok = cfg.process.tokenize
    sources: list[ModelSource] = []
    key = "process.tokenize.image.path_or_id"
    if tok.image is not None and tok.image.backend == "pairforge-vq":
        from pairforge.tokenizers.vqvae import CONFIG_NAME, WEIGHTS_NAME  # imports torch

        sources.append(ModelFolder(key, tok.image.path_or_id, ((CONFIG_NAME,), (WEIGHTS_NAME,)),
                                   hub=False))
    elif tok.image is not None:
        sources.append(ModelFolder(key, tok.image.path_or_id, (("config.json",), WEIGHT_FILES),
                                   tok.image.revision))
    if tok.text.backend == "hf" and tok.text.path_or_id:
        sources.append(ModelFolder("process.tokenize.text.path_or_id", tok.text.path_or_id,
                                   (TOKENIZER_FILES,), tok.text.revision))
    return tuple(sources)


def _shard_starts(rows: pa.Table) -> list[bool]:
    """Whether each row is its shard's first in the batch (a batch may span shards; once
    per batch left the layout to whichever shard led it, so stats differed run to run)."""
    if "shard" not in rows.column_names:
        return [i == 0 for i in range(rows.num_rows)]
    shards = rows["shard"].to_pylist()
    return [i == 0 or shard != shards[i - 1] for i, shard in enumerate(shards)]
