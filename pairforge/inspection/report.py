"""`pairforge report`: one self-contained HTML page about a dataset.

Sections: a summary; the funnel (table with each status's meaning, and a chart); the token
budget per task (table), the i2t share along each shard's prefix and the tokens per image
and caption; CLIP and classifier score histograms with their thresholds (or a note that
the step was off); recaption statistics with examples; thumbnails of the first samples with
caption and task; per-stage timings; the config. Charts are PNGs and thumbnails JPEGs,
embedded as data URLs (report_plots.py draws them): the file needs nothing beside it.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.config import ConfigError
from pairforge.inspection import report_plots as plots
from pairforge.inspection.duplicates import summary_lines
from pairforge.records import STATUS_HELP, Status
from pairforge.shards.dataset import check_output_folder, open_dataset
from pairforge.shards.failures import breakdown_note, breakdown_rows
from pairforge.shards.storage import DEDUP_FOLDER, RAW_FOLDER, SHARDS_FOLDER, OutputDir

# The charts are drawn from at most about this many rows, read from evenly spaced shards:
# a histogram of 10^9 values says no more than one of 10^5, and the page's counts come
# from the manifest, not from the rows.
SAMPLE_ROWS = 200_000
_ROW_COLUMNS = ["key", "task", "n_image_tokens", "n_caption_tokens", "clip_score", "caption",
                "recaption", "recaption_flags"]


def sampled_shards(manifest: dict[str, Any], most_rows: int | None = None
                   ) -> list[dict[str, Any]]:
    """Every k-th shard of the manifest, k chosen so that they hold about ``most_rows``
    (default SAMPLE_ROWS)."""
    most_rows = SAMPLE_ROWS if most_rows is None else most_rows
    shards = manifest["shards"]
    total = sum(s["samples"] for s in shards)
    step = max(1, -(-total // max(1, most_rows)))
    return shards[::step]


def _rows(out: OutputDir, manifest: dict[str, Any]) -> tuple[pa.Table, str]:
    """The chart columns of the sampled shards' rows, and a note saying which they are."""
    wanted = _ROW_COLUMNS + [c["score"] for c in manifest.get("classifiers") or []]
    chosen = sampled_shards(manifest)
    tables = []
    for shard in chosen:
        name = shard["name"].replace(".tar", ".parquet")
        with out.fs.open(out.path(SHARDS_FOLDER, name), "rb") as f:
            parquet = pq.ParquetFile(f)
            present = [c for c in wanted if c in parquet.schema_arrow.names]
            tables.append(parquet.read(columns=present))
    rows = pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})
    total = len(manifest["shards"])
    note = "" if len(chosen) == total else (
        f"charts and examples from the {rows.num_rows:,} rows of {len(chosen):,} of the "
        f"{total:,} shards (one in {-(-total // max(1, len(chosen)))}); counts and tables "
        "from the manifest")
    return rows, note


def _section(anchor: str, title: str, *parts: str) -> str:
    return f'<section id="{anchor}"><h2>{html.escape(title)}</h2>{"".join(parts)}</section>'


def _table(head: list[str], rows: list[list[Any]], numeric: Sequence[int] = (1,)) -> str:
    """An HTML table; cells are escaped, the ``numeric`` columns right-aligned."""
    def cell(tag: str, i: int, value: Any) -> str:
        align = ' class="n"' if i in numeric else ""
        text = f"{value:,}" if isinstance(value, int) else str(value)
        return f"<{tag}{align}>{html.escape(text)}</{tag}>"

    header = "".join(cell("th", i, h) for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>"


def _img(src: str, alt: str) -> str:
    return f'<p><img src="{src}" alt="{html.escape(alt)}"></p>'


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _values(rows: pa.Table, column: str) -> np.ndarray:
    if column not in rows.column_names:
        return np.asarray([])
    return rows[column].drop_null().to_numpy(zero_copy_only=False).astype(float)


def _histogram_or_number(values: np.ndarray, what: str, xlabel: str, title: str,
                         bounds: Sequence[tuple[float, str]] = ()) -> str:
    """A histogram, or one sentence when there is nothing to spread (none, or one value)."""
    if not len(values):
        return _note(f"no {what}")
    if plots.degenerate(values):
        return _note(f"every one of the {len(values):,} {what} is {values[0]:g}")
    return _img(plots.histogram(values, xlabel, title, bounds), title)


def _summary(path: str, out: OutputDir, manifest: dict[str, Any]) -> str:
    budget = manifest["budget"]
    lines = [f"{manifest['totals']['samples']:,} training samples from "
             f"{manifest['funnel']['input_rows']:,} input rows in {len(manifest['shards'])} "
             f"shards; p_drop {budget['p_drop']}, realized unconditional image-token share "
             f"{budget['realized_unconditional_share'] or 0:.4f} (largest prefix deviation "
             f"{budget['max_prefix_deviation_tokens'] or 0:.0f} tokens)",
             *summary_lines(out, manifest["funnel"]["final"])]
    if manifest.get("created"):
        lines.append(f"manifest written {manifest['created']}")
    if manifest.get("log"):
        lines.append(f"log of the run: {manifest['log']} (in the dataset folder)")
    return "".join(f"<p>{html.escape(line)}</p>" for line in lines)


def _funnel(manifest: dict[str, Any]) -> str:
    final, total = manifest["funnel"]["final"], manifest["funnel"]["input_rows"]
    ordered = sorted(final.items(), key=lambda kv: (kv[0] != Status.OK, -kv[1], kv[0]))
    rows = [[k, v, f"{v / max(total, 1):.1%}", STATUS_HELP.get(k, "")] for k, v in ordered]
    rescued = (manifest.get("recaption") or {}).get("rescued")
    if rescued:  # a part of ok, shown under it
        rows.insert(1, ["  of which: no usable alt-text, recaptioned", rescued,
                        f"{rescued / max(total, 1):.1%}",
                        "kept because recaptioning gave the image the caption its alt-text "
                        "could not (caption_issue: empty, file name, boilerplate...)"])
    rows.append(["total", sum(final.values()), "", ""])
    table = _table(["status", "rows", "share", "meaning"], rows, numeric=(1, 2))
    chart = _img(plots.funnel_chart(final, total), "funnel chart") if final else ""
    return _section("funnel", "Funnel: the final status of every input row", table, chart)


def _failures(manifest: dict[str, Any]) -> str:
    section = manifest.get("failures_by_host")
    rows = breakdown_rows(section)
    note = breakdown_note(section)
    table = _table(["host", "failed rows", "status", "rows", "meaning"], rows,
                   numeric=(1, 3)) if rows else ""
    return _section("failures", "Top hosts by failures (stage 1)",
                    table or _note("no row failed in stage 1"), _note(note) if note else "")


def _budget(rows: pa.Table, manifest: dict[str, Any]) -> str:
    tasks = manifest["totals"]["tasks"]
    if not tasks:
        return _section("budget", "Token budget per task",
                        _note("no tasks: the tokenize step was off (process.tokenize.enabled: "
                              "false), so samples carry no image tokens"))
    image_total = sum(t["image_tokens"] for t in tasks.values()) or 1
    table = _table(["task", "samples", "image tokens", "share of image tokens",
                    "caption tokens", "sequence tokens"],
                   [[task, t["samples"], t["image_tokens"],
                     f"{t['image_tokens'] / image_total:.2%}", t["caption_tokens"],
                     t["sequence_tokens"]] for task, t in tasks.items()], numeric=range(1, 6))
    return _section("budget", "Token budget per task", table, _prefix_share(rows, manifest),
                    _tokens(rows))


def _prefix_share(rows: pa.Table, manifest: dict[str, Any]) -> str:
    if "task" not in rows.column_names:
        return ""
    table = rows.filter(pc.is_valid(rows["task"]))
    keys = table["key"].to_pylist()
    shards = np.asarray([k[:5] for k in keys])
    tokens = np.asarray(table["n_image_tokens"].to_pylist(), dtype=float)
    uncond = np.isin(np.asarray(table["task"].to_pylist()), ["i2t", "img"])
    names = sorted(set(shards.tolist()))
    shares = {}
    for shard in names[:plots.MAX_SHARD_LINES]:
        mask = shards == shard
        shares[shard] = np.cumsum(tokens[mask] * uncond[mask]) / np.cumsum(tokens[mask])
    chart = plots.prefix_share_chart(shares, manifest["budget"]["p_drop"], len(names))
    return _img(chart, "i2t share along each shard")


def _tokens(rows: pa.Table) -> str:
    return (_histogram_or_number(_values(rows, "n_image_tokens"), "images' token counts",
                                 "image tokens per image", "image tokens per image")
            + _histogram_or_number(_values(rows, "n_caption_tokens"), "captions' token counts",
                                   "tokens per training caption", "tokens per caption"))


def _scores(rows: pa.Table, manifest: dict[str, Any]) -> str:
    clip_cfg = manifest["config"]["process"]["clip"]
    if not clip_cfg.get("enabled"):
        clip = _note("CLIP was off (process.clip.enabled: false): no clip_score")
    else:
        threshold = manifest["models"].get("clip_threshold")
        bounds = [(threshold, f"kept at or above {threshold:.3f}")] if (
            threshold is not None and clip_cfg.get("mode") != "score_only") else []
        clip = _histogram_or_number(
            _values(rows, "clip_score"), "CLIP scores",
            "clip_score: cosine of image and original caption",
            f"CLIP scores ({manifest['models'].get('clip')})", bounds)
    parts = [clip]
    for entry in manifest.get("classifiers") or []:
        bounds = [(entry[k], f"{side} {entry[k]:g} -> {entry['status']}")
                  for k, side in (("drop_above", "dropped above"), ("drop_below",
                                                                    "dropped below"))
                  if entry.get(k) is not None]
        title = (f"classifier {entry['name']}: {entry['rows_dropped']:,} of "
                 f"{entry['rows_scored']:,} scored rows dropped")
        parts.append(_histogram_or_number(
            _values(rows, entry["score"]), f"{entry['name']} scores",
            f"{entry['score']} ({entry['backend']} {entry['model']})", title, bounds))
    if not manifest.get("classifiers"):
        parts.append(_note("no image classifiers configured (process.classifiers: [])"))
    return _section("scores", "Scores and their thresholds", *parts)


def _recaption(rows: pa.Table, manifest: dict[str, Any]) -> str:
    stats = manifest.get("recaption")
    if not stats:
        return _section("recaption", "Recaptioning",
                        _note("recaptioning was off (process.recaption.enabled: false): "
                              "training captions are the original alt-text"))
    counts = [["rows recaptioned", stats["rows"]], ["abstained (no caption trusted)",
                                                    stats["abstained"]],
              ["failed (no answer from the captioner)", stats.get("failed", 0)],
              ["rows with attributes removed", stats["rows_with_attributes_removed"]],
              ["regenerated", stats["regenerated"]]]
    counts += [[f"origin: {k}", v] for k, v in stats.get("origin", {}).items()]
    counts += [[f"training caption: {k}", v] for k, v in stats.get("caption_source", {}).items()]
    counts += [[f"check: {k}", v] for k, v in stats.get("flags", {}).items()]
    examples = []
    if "recaption" in rows.column_names:
        done = rows.filter(pc.is_valid(rows["recaption"])).slice(0, 6).to_pylist()
        examples = [[r["key"], r.get("caption") or "", r["recaption"],
                     ", ".join(r.get("recaption_flags") or []) or "-"] for r in done]
    model = manifest["models"].get("recaption")
    return _section("recaption", "Recaptioning" + (f" ({model})" if model else ""),
                    _table(["", "rows"], counts),
                    "<h3>examples</h3>" + _table(["key", "original caption", "recaption",
                                                  "checks"], examples, numeric=())
                    if examples else "")


def _thumbnails(out: OutputDir, n: int = 12) -> str:
    from pairforge.inspection.contact_sheet import sample_image, select_samples

    tiles = []
    for sample in select_samples(out, None, None, n):
        image = sample_image(sample)
        image.thumbnail((128, 128))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=85)
        src = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
        task = sample["json"].get("task") or "-"
        tiles.append(f'<figure><img src="{src}" alt="{sample["__key__"]}"><figcaption>'
                     f'<b>{html.escape(task)}</b> {html.escape(sample["__key__"])}<br>'
                     f'{html.escape(sample["txt"])}</figcaption></figure>')
    body = f'<div class="grid">{"".join(tiles)}</div>' if tiles else _note("no samples")
    return _section("samples", f"The first {len(tiles)} samples", body)


def _timings(out: OutputDir, manifest: dict[str, Any]) -> str:
    rows: list[list[Any]] = []
    shards = seconds = count = 0
    for name in out.glob(f"{RAW_FOLDER}/*_stats.json"):  # one at a time: 10^5 at 10^9 rows
        stats = out.read_json(RAW_FOLDER, name.rsplit("/", 1)[-1])
        shards += 1
        seconds += stats.get("duration_s") or 0
        count += stats.get("count", 0)
    if shards:
        rows.append(["download", "shard tasks", count, f"{seconds:.1f}",
                     f"{count / seconds:,.1f}" if seconds else "-"])
    if out.exists(DEDUP_FOLDER, "dedup_stats.json"):
        dedup = out.read_json(DEDUP_FOLDER, "dedup_stats.json")
        total = (dedup.get("seconds") or {}).get("total")
        if total is not None:
            rows.append(["dedup", "read + join", dedup.get("rows_in", 0), f"{total:.1f}",
                         f"{dedup.get('rows_in', 0) / total:,.1f}" if total else "-"])
    for name, step in (manifest.get("steps") or {}).items():
        rate = f"{step['rows_in'] / step['seconds']:,.1f}" if step["seconds"] else "-"
        rows.append(["process", name, step["rows_in"], f"{step['seconds']:.1f}", rate])
    note = _note("seconds are summed over the tasks or actors that did the work (several run "
                 "at once), so a rate is per worker, not for the whole machine")
    return _section("timings", "Timings", _table(["stage", "part", "rows", "seconds",
                                                  "rows/s"], rows, numeric=(2, 3, 4)), note)


def _cost(manifest: dict[str, Any]) -> str:
    from pairforge.inspection.cost import from_manifest, lines

    if not manifest.get("steps"):
        return _section("cost", "Cost", _note("no step seconds in the manifest"))
    paragraphs = "".join(f"<p>{html.escape(line)}</p>" for line in lines(from_manifest(manifest)))
    return _section("cost", "Cost (pairforge cost)", paragraphs, _note(
        "device-seconds are the steps' own on the device this build ran on; price and "
        "projection sizes from the config's cost section"))


def _config(manifest: dict[str, Any]) -> str:
    import yaml

    text = yaml.safe_dump(manifest["config"], sort_keys=False)
    return _section("config", "Config of the build",
                    f"<details open><summary>YAML</summary><pre>{html.escape(text)}</pre>"
                    "</details>")


STYLE = """body{font-family:sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;
color:#222}table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;
padding:.2em .5em;vertical-align:top}th{background:#f3f3f3}.n{text-align:right}
.note{color:#555;font-style:italic}.grid{display:flex;flex-wrap:wrap;gap:8px}
figure{width:140px;margin:0;font-size:11px}figure img{display:block}
pre{background:#f7f7f7;padding:.5em;font-size:12px;overflow:auto}nav a{margin-right:1em}"""
SECTIONS = [("funnel", "funnel"), ("failures", "failures by host"), ("budget", "token budget"),
            ("scores", "scores"), ("recaption", "recaptioning"), ("samples", "samples"),
            ("timings", "timings"), ("cost", "cost"), ("config", "config")]


def render_report(path: str, storage_options: dict | None = None) -> str:
    out, manifest = open_dataset(path, storage_options)
    rows, sampled = _rows(out, manifest)
    nav = "<nav>" + "".join(f'<a href="#{a}">{t}</a>' for a, t in SECTIONS) + "</nav>"
    body = [_summary(path, out, manifest), _note(sampled) if sampled else "", nav,
            _funnel(manifest), _failures(manifest), _budget(rows, manifest),
            _scores(rows, manifest), _recaption(rows, manifest), _thumbnails(out),
            _timings(out, manifest), _cost(manifest), _config(manifest)]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>pairforge report: "
            f"{html.escape(path)}</title><style>{STYLE}</style></head><body>"
            f"<h1>pairforge report: {html.escape(path)}</h1>{''.join(body)}</body></html>")


def write_report(path: str, output: str, storage_options: dict | None = None) -> None:
    """Render the report, then write it: a dataset that cannot be read leaves no file."""
    check_output_folder(output)
    page = render_report(path, storage_options)
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as err:
        raise ConfigError(f"-o {output}: cannot write ({err.strerror or err})") from None
