"""The ``pairforge`` command: one subcommand per verb of DESIGN.md section 1."""

from __future__ import annotations

import json
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from pairforge import __version__
from pairforge.config import ConfigError, PairforgeConfig, load_config
from pairforge.inspection.summary import status_table
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.progress import console
from pairforge.shards.labels import I2T, IMG, T2I
from pairforge.tokenizers.cli import app as tokenizers_app
from pairforge.train.cli import sample as sample_command
from pairforge.train.cli import train as train_command

# Plain click help (rich_markup_mode=None): typer's rich panels print a type such as
# "<bool>" beside every flag, --help included. -h is the short help everywhere (click passes
# help_option_names down to every subcommand).
app = typer.Typer(no_args_is_help=True, pretty_exceptions_show_locals=False,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Build image-text pretraining shards for unified autoregressive models.")
app.add_typer(tokenizers_app, name="tokenizers")
config_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="Write or check a config file.")
app.add_typer(config_app, name="config")
app.command("train")(train_command)
app.command("sample")(sample_command)

ConfigArg = Annotated[Path, typer.Argument(help="YAML config file", exists=False,
                                           metavar="CONFIG")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE",
    help="override a config key, e.g. --set download.threads=64 (repeatable)")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="plain progress lines every few seconds instead of the live display "
    "(also what a non-terminal gets)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON on stdout instead of tables")]


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"pairforge {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="print the version and exit")] = False) -> None:
    """Build image-text pretraining shards for unified autoregressive models."""
ForceOpt = Annotated[bool, typer.Option(
    "--force", help="redo every shard, complete or not, whatever settings it was made "
    "under")]
RedoChangedOpt = Annotated[bool, typer.Option(
    "--redo-changed", help="redo the complete shards made under other settings and keep "
    "the rest (without it, or --force, such a rerun stops before any work and names what "
    "changed)")]


def _user_error(err: Exception) -> typer.Exit:
    """Print a user error as one paragraph (no markup read from it, no wrapping inside a
    path) and return the exit that says so: code 2."""
    console.print(f"[red]error:[/red] {escape(str(err))}")
    return typer.Exit(2)


def _load(config: Path, overrides: list[str] | None) -> PairforgeConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as err:
        raise _user_error(err) from None


def _print_log(summary: dict[str, Any], out: str) -> None:
    if summary.get("log"):
        console.print(f"log: {out.rstrip('/')}/{summary['log']}", highlight=False)


def _print_stage(name: str, summary: dict[str, Any], out: str) -> None:
    rate = summary.get("rows_per_s")
    note = f", {rate:,} rows/s" if rate else ""
    skipped = summary.get("shards_skipped", 0)
    console.print(f"[b]{name}[/b]: {summary['shards']} shards ({skipped} already complete), "
                  f"{summary['rows']:,} rows in {summary.get('seconds', 0)} s{note}")
    console.print(status_table(summary["status"], f"{name} funnel"))
    semantic = summary.get("semantic_dedup")
    if semantic:  # stage 3's semantic pass (dedup.semantic)
        console.print(f"[b]semantic dedup[/b]: {semantic.get('duplicate_semantic', 0):,} of "
                      f"{semantic.get('embeddings', 0):,} embedded rows dropped "
                      f"({semantic.get('clusters', 0):,} clusters, cosine >= "
                      f"{semantic.get('threshold')})")
    _print_log(summary, out)


def _run_guarded(fn, *args):  # noqa: ANN001, ANN202
    """Turn start-up problems (bad input, missing column) into a clear message."""
    try:
        return fn(*args)
    except ConfigError as err:
        raise _user_error(err) from None


def _options(force: bool, quiet: bool, redo_changed: bool = False) -> RunOptions:
    """``--force`` redoes every shard (so the changed ones too); ``--redo-changed`` only the
    shards made under other settings."""
    return RunOptions(force=force or redo_changed, redo_all=force, show_progress=not quiet)


def _preflight(cfg: PairforgeConfig, stage: str) -> None:
    """Every problem that would stop ``stage`` later, named now, before Ray starts."""
    from pairforge.pipeline.preflight import preflight

    _run_guarded(preflight, cfg, stage)


@app.command()
def download(config: ConfigArg, set_: SetOpt = None, quiet: QuietOpt = False,
             force: ForceOpt = False, redo_changed: RedoChangedOpt = False,
             retry_failed: Annotated[bool, typer.Option(
                 "--retry-failed", help="fetch again only the rows of complete shards "
                 "whose failure may pass (timeout, connection, 429, 5xx, host_paused) and "
                 "rewrite those shards with the same keys")] = False) -> None:
    """Stage 1: fetch, verify, resize and hash every input row into raw shards."""
    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.retry_failed import run_retry_failed

    if force and retry_failed:
        raise _user_error(ValueError("--force redoes every shard and --retry-failed only the "
                                     "failures of complete ones: give one of them"))
    cfg = _load(config, set_)
    _preflight(cfg, "download")
    runner = run_retry_failed if retry_failed else run_download
    _print_stage("download", _run_guarded(runner, cfg, _options(force, quiet, redo_changed)),
                 cfg.output.path)


def _print_dedup(stats: dict[str, Any], out: str) -> None:
    if not stats.get("enabled", True):
        console.print("[b]dedup[/b]: disabled")
        _print_log(stats, out)
        return
    fields = ["ok_rows", "duplicate_exact", "duplicate_near", "duplicate_mirror",
              "duplicate_crop", "clusters", "kept",
              "degenerate_hashes", "dense_phashes", "index_rows"]
    shown = ", ".join(f"{f.replace('_', ' ')} {stats[f]:,}" for f in fields if f in stats)
    console.print(f"[b]dedup[/b]: {shown}")
    _print_log(stats, out)


@app.command()
def dedup(config: ConfigArg, set_: SetOpt = None, quiet: QuietOpt = False,
          force: Annotated[bool, typer.Option(
              "--force", help="redo even when a finished dedup matches the inputs (it redoes "
              "itself when they changed)")] = False,
          ) -> None:
    """Stage 2: exact and near duplicates from the raw shards' hashes (redone when the raw
    shards, the index files or the dedup config changed since the last run)."""
    from pairforge.pipeline.dedup_stage import run_dedup_stage

    cfg = _load(config, set_)
    _preflight(cfg, "dedup")
    _print_dedup(_run_guarded(run_dedup_stage, cfg, _options(force, quiet)), cfg.output.path)


@app.command()
def process(config: ConfigArg, set_: SetOpt = None, quiet: QuietOpt = False,
            force: ForceOpt = False, redo_changed: RedoChangedOpt = False) -> None:
    """Stage 3: filters and model steps over the raw shards into training shards."""
    from pairforge.pipeline.process import run_process

    cfg = _load(config, set_)
    _preflight(cfg, "process")
    _print_stage("process", _run_guarded(run_process, cfg, _options(force, quiet, redo_changed)),
                 cfg.output.path)


@app.command()
def build(config: ConfigArg, set_: SetOpt = None, quiet: QuietOpt = False,
          force: ForceOpt = False, redo_changed: RedoChangedOpt = False) -> None:
    """Run every stage in order; complete shards of earlier runs are skipped."""
    from pairforge.pipeline.dedup_stage import run_dedup_stage
    from pairforge.pipeline.download_stage import run_download
    from pairforge.pipeline.process import check_process_placement, run_process
    from pairforge.pipeline.settings import check_settings

    cfg = _load(config, set_)
    _preflight(cfg, "build")  # before hours of downloading, not after
    _run_guarded(check_process_placement, cfg)  # stage 3's GPUs, also before stage 1
    # every stage's complete shards are checked now, once: a stage-3 change stops the build
    # before stage 1, not after it, and the stages do not read the stats files again
    run = _run_guarded(check_settings, cfg, ("download", "process"),
                       _options(force, quiet, redo_changed))
    _print_stage("download", _run_guarded(run_download, cfg, run), cfg.output.path)
    # dedup redoes itself when the raw shards changed; --force redoes it whatever
    _print_dedup(_run_guarded(run_dedup_stage, cfg, replace(run, force=run.redo_all)),
                 cfg.output.path)
    _print_stage("process", _run_guarded(run_process, cfg, run), cfg.output.path)
    out = cfg.output.path
    console.print(f"training shards: [b]{out}/shards/[/b], manifest: [b]{out}/manifest.json[/b]")
    console.print(f"next: [b]pairforge inspect[/b] {out}   [b]pairforge show[/b] {out} -o sheet.png"
                  f"   [b]pairforge verify[/b] {out}")


PathArg = Annotated[str, typer.Argument(help="dataset folder (OUT) or fsspec URL",
                                        metavar="OUT")]
# --task's allowed values: click rejects others with exit 2 and lists these
TaskChoice = Enum("TaskChoice", {t: t for t in (T2I, I2T, IMG)}, type=str)


def _data_console() -> Console:
    """stdout, for what a read-only verb answers (``pairforge inspect OUT > f`` keeps it);
    messages stay on stderr. Made per call: tests swap sys.stdout."""
    return Console(soft_wrap=False)


@app.command()
def inspect(path: PathArg, json_: JsonOpt = False) -> None:
    """The dataset at a glance: funnel, token budget per task, shards, models."""
    from pairforge.inspection.summary import inspect_data, inspect_view
    from pairforge.shards.dataset import open_dataset

    _run_guarded(open_dataset, path)  # not a dataset: say so, exit 2
    if json_:
        typer.echo(json.dumps(inspect_data(path), indent=1))
        return
    _data_console().print(inspect_view(path))


@app.command()
def show(path: PathArg,
         output: Annotated[str, typer.Option("-o", "--output", help="PNG to write")] = "sheet.png",
         task: Annotated[TaskChoice | None, typer.Option(help="only this task")] = None,
         grep: Annotated[str | None, typer.Option(help="only captions with this word")] = None,
         n: Annotated[int, typer.Option("-n", help="samples on the sheet")] = 16,
         status: Annotated[str | None, typer.Option(
             help="rows that left with this status instead (e.g. unsafe: what a "
             "classifier dropped)")] = None,
         duplicates: Annotated[bool, typer.Option(
             "--duplicates", help="dropped duplicates (of --status's kind, or all), each "
             "beside the row that was kept")] = False) -> None:
    """A contact sheet: image, VQ reconstruction, task, CLIP score and caption."""
    from pairforge.inspection.contact_sheet import show as make_sheet

    notes: list[str] = []
    shown = _run_guarded(make_sheet, path, output, task and task.value, grep, n, None, notes,
                         status, duplicates)
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
    if not shown:
        console.print("[yellow]no sample matches[/yellow]")
        raise typer.Exit(1)
    console.print(f"{shown} samples → [b]{output}[/b]")


@app.command()
def report(path: PathArg,
           output: Annotated[str, typer.Option("-o", "--output", help="HTML to write")]
           = "report.html") -> None:
    """One self-contained HTML page: funnel, CLIP scores, budget along shards, token counts."""
    from pairforge.inspection.report import write_report

    _run_guarded(write_report, path, output)
    console.print(f"report → [b]{output}[/b]")


@app.command()
def verify(path: PathArg, json_: JsonOpt = False) -> None:
    """Re-read every tar and check it against manifest.json; exit 1 on any problem."""
    from pairforge.inspection.verify import verify_dataset
    from pairforge.shards.dataset import open_dataset

    _run_guarded(open_dataset, path)  # not a dataset is a user error (2), not a finding (1)
    problems = verify_dataset(path)
    if json_:
        typer.echo(json.dumps({"path": path, "ok": not problems, "problems": problems},
                              indent=1))
    else:  # the findings are the answer: stdout, one a line
        out = _data_console()
        for problem in problems:
            out.print(f"[red]✗[/red] {escape(problem)}", soft_wrap=True)
        out.print(f"[red]{len(problems)} problem(s)[/red]" if problems
                  else "[green]✓[/green] every shard matches manifest.json")
    if problems:
        raise typer.Exit(1)


@app.command()
def cost(path: PathArg,
         price: Annotated[float | None, typer.Option(
             "--price-per-second", help="dollars per device-second [default: the build's "
             "cost.price_per_device_second]")] = None,
         images: Annotated[int | None, typer.Option(
             help="images in the projected backfill [default: cost.backfill_images]")] = None,
         per_day: Annotated[int | None, typer.Option(
             help="images per day on demand [default: cost.images_per_day]")] = None,
         seconds_per_image: Annotated[float | None, typer.Option(
             help="device-seconds per generated caption measured elsewhere (e.g. a GPU run) "
             "instead of this build's")] = None,
         serve_seconds: Annotated[float | None, typer.Option(
             help="on demand: device-seconds per caption measured on pairforge serve (a "
             "replica's devices / its saturation images/s, bench/serve.py) [default: the "
             "build's per generated caption]")] = None,
         serve_hit_rate: Annotated[float, typer.Option(
             min=0.0, max=1.0, help="on demand: the share of uploads the service's cache "
             "answers")] = 0.0,
         json_: JsonOpt = False) -> None:
    """What captioning this build cost per image, and a backfill and a daily rate would."""
    from pairforge.inspection.cost import from_manifest, lines
    from pairforge.shards.dataset import open_dataset

    _, manifest = _run_guarded(open_dataset, path)
    figures = from_manifest(manifest, price, images, per_day, seconds_per_image,
                            serve_seconds, serve_hit_rate)
    if json_:
        typer.echo(json.dumps(figures, indent=1))
        return
    for line in lines(figures):
        _data_console().print(escape(line), soft_wrap=True)


@app.command("recaption-eval")
def recaption_eval(
    config: ConfigArg,
    table: Annotated[Path, typer.Argument(
        metavar="REFS", help="table (.parquet, .csv, .jsonl) of image paths, reference "
        "captions and stratum columns")],
    stratum: Annotated[list[str] | None, typer.Option(
        "--stratum", metavar="COLUMN", help="a column whose values are the strata "
        "(repeatable) [default: evaluation.strata]")] = None,
    max_gap: Annotated[list[str] | None, typer.Option(
        "--max-gap", metavar="METRIC=VALUE", help="the largest gap allowed between strata, "
        "e.g. --max-gap cider_d=0.5 (cider_d, hallucination, specificity, abstention; none "
        "lifts a bound; repeatable) [default: evaluation.max_gap]")] = None,
    output: Annotated[Path | None, typer.Option(
        "--json", metavar="FILE", help="write the figures, the gaps and every caption as "
        "JSON")] = None,
    set_: SetOpt = None,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="no progress lines on stderr")] = False) -> None:
    """Caption a table of images with the configured recaption step and measure it per
    stratum: CIDEr-D, hallucination, specificity, abstention; exit 1 when a gap between
    strata exceeds its bound."""
    from pairforge.pipeline.preflight import recaption_problems
    from pairforge.recaption import evaluate

    cfg = _load(config, set_)
    cfg.process.recaption.enabled = True  # what is evaluated is the recaption step
    strata = list(stratum or cfg.evaluation.strata)
    bounds = _run_guarded(evaluate.parse_bounds, cfg.evaluation, max_gap or [])
    rows = _run_guarded(evaluate.read_table, table, cfg.evaluation, strata)
    problems = recaption_problems(cfg)
    if problems:
        raise _user_error(ConfigError("recaption-eval cannot start:\n  " + "\n  ".join(problems)))

    def progress(done: int, total: int) -> None:
        if not quiet:
            console.print(f"captioned {done}/{total}", highlight=False)

    evaluate.caption_rows(cfg.process.recaption, cfg.process.clip, rows, progress)
    result = evaluate.summarize(rows, strata, cfg.evaluation, bounds)
    out = _data_console()
    for view in evaluate.tables(result):
        out.print(view)
    if output is not None:
        output.write_text(json.dumps({"table": str(table), **result}, indent=1))
        console.print(f"→ {output}", highlight=False)
    failures = evaluate.verdict(result)
    for line in failures:
        console.print(f"[red]gap too large:[/red] {escape(line)}")
    if failures:
        raise typer.Exit(1)


@app.command("serve")
def serve_command(
    config: ConfigArg,
    host: Annotated[str | None, typer.Option(help="listen address [default: serve.host]")]
    = None,
    port: Annotated[int | None, typer.Option(help="listen port [default: serve.port]")] = None,
    set_: SetOpt = None,
) -> None:
    """On-demand captions over HTTP (Ray Serve): POST /v1/captions, with the recaption
    step's captioner and safety checks (pairforge/serve)."""
    from pairforge.serve.run import serve_until_interrupted, start_service

    cfg = _load(config, set_)
    _preflight(cfg, "serve")
    url = _run_guarded(start_service, cfg, host, port)
    console.print(f"serving captions of {escape(cfg.process.recaption.model)} on {url} "
                  "(POST /v1/captions, GET /readyz, /metrics, /docs); Ctrl-C stops",
                  highlight=False)
    serve_until_interrupted()


@app.command("eval")
def eval_run(
    run: Annotated[str, typer.Argument(help="training run folder (or its checkpoint.pt)")],
    output: Annotated[Path, typer.Option("--json", "-o", help="JSON to write")]
    = Path("eval.json"),
    prompts: Annotated[int, typer.Option(help="held-out prompts to draw")] = 200,
    captions: Annotated[int, typer.Option(help="held-out images to caption")] = 200,
    cfg_scale: Annotated[list[float] | None, typer.Option(
        metavar="SCALE", help="classifier-free guidance scale; give it more than once to "
        "choose the best on separate validation prompts [default: 1.0, 1.5, 3.0]")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    sheet: Annotated[Path | None, typer.Option(help="PNG of the first drawings")] = None,
) -> None:
    """Scene world: prompt adherence of a run's CFG drawings (judged) and the accuracy of
    its greedy captions, on held-out scenes (pairforge/scenes)."""
    cfg_scale = cfg_scale or [1.0, 1.5, 3.0]
    from pairforge.scenes.evaluate import evaluate_run, table, write_json

    result = _run_guarded(evaluate_run, run, prompts, captions, cfg_scale, 1.0, 0, seed, sheet)
    typer.echo(table(result))
    write_json(result, output)
    typer.echo(f"→ {output}")


@config_app.command("example")
def config_example() -> None:
    """Print a complete config: every key at its default, each with its description."""
    from pairforge.config import EXAMPLE_PLACEHOLDERS
    from pairforge.config_example import example_yaml

    typer.echo(example_yaml(PairforgeConfig, EXAMPLE_PLACEHOLDERS), nl=False)


@config_app.command("check")
def config_check(config: ConfigArg, set_: SetOpt = None) -> None:
    """Validate CONFIG (with any --set overrides): exit 0 if valid, else 2 naming the key."""
    _load(config, set_)
    typer.echo(f"{config}: valid")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
