"""``pairforge tokenizers ...``: train our VQ image tokenizer and a caption BPE."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Train and inspect tokenizers.", no_args_is_help=True)


@app.command("train-vq")
def train_vq_command(
    sources: list[Path] = typer.Argument(..., exists=True,
                                         help="image folders and/or raw-shard .tar files"),
    out: Path = typer.Option(..., "--out", "-o", help="checkpoint folder to write"),
    resolution: int = typer.Option(64, help="square input side in pixels"),
    codebook_size: int = typer.Option(512, help="K, number of image codes"),
    channels: str = typer.Option("32,64", help="widths per level; downsample = 2 ** levels"),
    embed_dim: int = typer.Option(16, help="code vector size"),
    steps: int = typer.Option(1000, help="optimiser steps"),
    batch_size: int = typer.Option(16, help="images per step"),
    lr: float = typer.Option(2e-3, help="peak learning rate (one-cycle schedule)"),
    holdout: float = typer.Option(0.1, help="fraction of images held out for the report"),
    seed: int = typer.Option(0),
    threads: int = typer.Option(0, help="torch CPU threads (0: all cores of this process)"),
    max_images: int = typer.Option(0, help="read at most this many images (0: all)"),
) -> None:
    """Train the convolutional VQ-VAE; print held-out PSNR and codebook usage."""
    from pairforge.tokenizers.train_vq import default_threads, train_vq

    metrics = train_vq(
        [str(s) for s in sources], out, resolution=resolution, codebook_size=codebook_size,
        channels=[int(c) for c in channels.split(",")], embed_dim=embed_dim, steps=steps,
        batch_size=batch_size, lr=lr, holdout=holdout, seed=seed,
        num_threads=threads or default_threads(), max_images=max_images or None,
        log=typer.echo)
    typer.echo(json.dumps(metrics, indent=2))


@app.command("train-text")
def train_text_command(
    sources: list[Path] = typer.Argument(
        ..., exists=True,
        help="csv/tsv/jsonl/parquet (caption column), txt (one per line) or .tar shards"),
    out: Path = typer.Option(..., "--out", "-o", help="tokenizer folder to write"),
    vocab_size: int = typer.Option(8192, help="BPE vocabulary size (256 bytes included)"),
    column: str = typer.Option("caption", help="caption column of tables"),
    min_frequency: int = typer.Option(2, help="merges must occur at least this often"),
) -> None:
    """Train a byte-level BPE on captions; loadable with PreTrainedTokenizerFast."""
    from pairforge.tokenizers.text import HFTextTokenizer, read_captions, train_bpe

    captions = list(read_captions([str(s) for s in sources], column=column))
    if not captions:
        raise typer.BadParameter("no captions found in the given sources")
    train_bpe(captions, out, vocab_size=vocab_size, min_frequency=min_frequency)
    tokenizer = HFTextTokenizer(str(out))
    lengths = [len(tokenizer.encode(c)) for c in captions]
    typer.echo(f"trained on {len(captions)} captions: vocab {tokenizer.vocab_size}, "
               f"{sum(lengths) / len(lengths):.1f} tokens per caption; saved to {out}")
