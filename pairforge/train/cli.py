"""``pairforge train CONFIG`` and ``pairforge sample RUN``; torch loads only when they run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)

SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE",
    help="override a config key, e.g. --set run.steps=200 (repeatable)")]


@app.command()
def train(config: Annotated[Path, typer.Argument(help="train YAML config", metavar="CONFIG")],
          set_: SetOpt = None,
          quiet: Annotated[bool, typer.Option(
              "--quiet", "-q", help="no progress line every run.log_every steps (steps/s, "
              "tokens/s, ETA); report.json keeps them")] = False) -> None:
    """Train the bundled decoder-only model on training shards; writes OUT/report.json.

    Run with torchrun for DDP, e.g. torchrun --standalone --nproc_per_node 2 -m
    pairforge.cli train CONFIG.
    """
    from pairforge.config import ConfigError
    from pairforge.tokenizers.vocab import VocabMismatch
    from pairforge.train.config import load_train_config

    try:
        cfg = load_train_config(config, set_ or [])
        from pairforge.train.loop import train as run_training

        report = run_training(cfg, log=typer.echo, quiet=quiet)
    except (ConfigError, VocabMismatch, FileNotFoundError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if os.environ.get("RANK", "0") != "0":
        return  # under torchrun, rank 0 speaks for the run
    final = report["final"]["heldout"] or report["final"]["train"]
    typer.echo(json.dumps({k: final[k] for k in ("loss", "L_I|T", "L_I|0", "L_T|I")}))


@app.command()
def sample(
    run: Annotated[str, typer.Argument(help="training output folder (or its checkpoint.pt)")],
    output: Annotated[str, typer.Option("-o", "--output", help="PNG sheet to write")]
    = "samples.png",
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", "-p", metavar="TEXT",
        help="caption to draw (repeatable); default: held-out captions")]
    = None,
    n: Annotated[int, typer.Option("-n", help="held-out samples to use")] = 8,
    cfg_scale: Annotated[float, typer.Option(
        help="classifier-free guidance scale (1: none; models trained on clean captions "
             "draw best without it, see `pairforge eval`, which chooses per run)")] = 1.0,
    temperature: Annotated[float, typer.Option(help="image-token sampling temperature")] = 1.0,
    top_k: Annotated[int, typer.Option(help="sample among the k likeliest codes (0: all)")]
    = 0,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Draw images from captions (CFG) and caption held-out images (greedy): a PNG sheet
    plus a JSON of the captions next to it."""
    from pairforge.config import ConfigError
    from pairforge.train.sampling import sample_run

    try:
        result = sample_run(run, output, prompts=prompt or None, n=n, cfg_scale=cfg_scale,
                            temperature=temperature, top_k=top_k, seed=seed)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{len(result['images'])} images, {len(result['captions'])} captions → "
               f"{output}, {result['json']}")
