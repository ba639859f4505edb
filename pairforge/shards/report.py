"""`pairforge report`: one self-contained HTML page with the dataset's plots.

Plots (PNG, embedded as data URLs): the funnel, the CLIP-score histogram with the
threshold, a histogram per classifier score with its bound, the i2t share of image
tokens along each shard's prefix against the target, and the tokens per image and per
caption.
"""

from __future__ import annotations

import base64
import html
import io
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.config import ConfigError
from pairforge.shards.duplicates import summary_lines
from pairforge.shards.storage import SHARDS_FOLDER, OutputDir

MANIFEST = "manifest.json"


def open_dataset(path: str, storage_options: dict | None = None) -> tuple[OutputDir, dict]:
    """The dataset folder and its manifest; ``ConfigError`` when ``path`` is not a dataset
    (the commands that read one answer with a message, not a traceback)."""
    try:
        out = OutputDir(path, storage_options)
        found = out.exists(MANIFEST)
    except Exception as err:  # noqa: BLE001 - an unknown protocol, a bad bucket name ...
        raise ConfigError(f"{path}: cannot open ({type(err).__name__}: {err})") from None
    if not found:
        what = "has no manifest.json" if out.exists() else "does not exist"
        raise ConfigError(f"{path} {what}, so it is not a pairforge dataset: make one with "
                          "`pairforge build CONFIG` and pass its output.path")
    return out, out.read_json(MANIFEST)


def _rows(out: OutputDir, manifest: dict[str, Any]) -> pa.Table:
    tables = []
    for shard in manifest["shards"]:
        name = shard["name"].replace(".tar", ".parquet")
        with out.fs.open(out.path(SHARDS_FOLDER, name), "rb") as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables, promote_options="permissive")


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _funnel(plt: Any, manifest: dict[str, Any]) -> str:
    final = sorted(manifest["funnel"]["final"].items(), key=lambda kv: -kv[1])
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(final) + 1))
    ax.barh([k for k, _ in final][::-1], [v for _, v in final][::-1], color="#4c72b0")
    ax.set_xlabel("rows")
    ax.set_title(f"funnel: {manifest['funnel']['input_rows']:,} input rows, final status")
    return _png(fig)


def _clip(plt: Any, rows: pa.Table, manifest: dict[str, Any]) -> str | None:
    if "clip_score" not in rows.column_names:
        return None
    scores = rows["clip_score"].drop_null().to_numpy()
    if not len(scores):
        return None
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.hist(scores, bins=40, color="#55a868")
    threshold = manifest["models"].get("clip_threshold")
    if threshold is not None:
        ax.axvline(threshold, color="#c44e52", label=f"threshold {threshold:.3f}")
        ax.legend()
    ax.set_xlabel("clip_score (cosine similarity, original caption)")
    ax.set_title("CLIP score distribution")
    return _png(fig)


def _classifier_scores(plt: Any, rows: pa.Table, manifest: dict[str, Any]) -> list[str]:
    """One histogram per classifier score over the rows it scored, with its bound."""
    plots = []
    for entry in manifest.get("classifiers") or []:
        column = entry["score"]
        if column not in rows.column_names:
            continue
        scores = rows[column].drop_null().to_numpy()
        if not len(scores):
            continue
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.hist(scores, bins=40, color="#64b5cd")
        for bound, side in (("drop_above", "dropped above"), ("drop_below", "dropped below")):
            if entry.get(bound) is not None:
                ax.axvline(entry[bound], color="#c44e52",
                           label=f"{side} {entry[bound]:g} ({entry['status']})")
                ax.legend()
        ax.set_xlabel(f"{column} ({entry['backend']} {entry['model']}"
                      + (f", label {entry['label']}" if entry.get("label") else "") + ")")
        ax.set_title(f"classifier {entry['name']}: {entry['rows_dropped']:,} of "
                     f"{entry['rows_scored']:,} scored rows dropped")
        plots.append(_png(fig))
    return plots


def _prefix_share(plt: Any, rows: pa.Table, manifest: dict[str, Any]) -> str | None:
    if "task" not in rows.column_names:
        return None
    fig, ax = plt.subplots(figsize=(7, 3))
    target = manifest["budget"]["p_drop"]
    table = rows.filter(pa.compute.is_valid(rows["task"]))
    keys = np.asarray(table["key"].to_pylist())
    shards = np.asarray([k[:5] for k in keys])
    tokens = np.asarray(table["n_image_tokens"].to_pylist(), dtype=float)
    uncond = np.isin(np.asarray(table["task"].to_pylist()), ["i2t", "img"])
    for shard in sorted(set(shards.tolist()))[:20]:
        mask = shards == shard
        share = np.cumsum(tokens[mask] * uncond[mask]) / np.cumsum(tokens[mask])
        ax.plot(np.arange(1, mask.sum() + 1), share, linewidth=0.8, alpha=0.7)
    ax.axhline(target, color="black", linestyle="--", label=f"target p_drop {target}")
    ax.set_xlabel("samples into the shard")
    ax.set_ylabel("i2t + img share of image tokens")
    ax.set_title("budget along each shard's prefix (first 20 shards)")
    ax.legend()
    return _png(fig)


def _tokens(plt: Any, rows: pa.Table) -> str | None:
    if "n_image_tokens" not in rows.column_names:
        return None
    image = rows["n_image_tokens"].drop_null().to_numpy()
    caption = rows["n_caption_tokens"].drop_null().to_numpy()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3))
    left.hist(image, bins=30, color="#8172b2")
    left.set_title("image tokens per image")
    right.hist(caption, bins=30, color="#937860")
    right.set_title("tokens per caption")
    return _png(fig)


def render_report(path: str, storage_options: dict | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, manifest = open_dataset(path, storage_options)
    rows = _rows(out, manifest)
    plots = [p for p in (_funnel(plt, manifest), _clip(plt, rows, manifest),
                         *_classifier_scores(plt, rows, manifest),
                         _prefix_share(plt, rows, manifest), _tokens(plt, rows)) if p]
    budget = manifest["budget"]
    summary = (f"{manifest['totals']['samples']:,} samples from "
               f"{manifest['funnel']['input_rows']:,} input rows in {len(manifest['shards'])} "
               f"shards; p_drop {budget['p_drop']}, realized unconditional share "
               f"{budget['realized_unconditional_share'] or 0:.4f}")
    summary += "; " + "; ".join(summary_lines(out, manifest["funnel"]["final"]))
    images = "\n".join(f'<p><img src="{p}"></p>' for p in plots)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>pairforge report"
            f"</title></head><body style='font-family:sans-serif'>"
            f"<h1>pairforge report: {html.escape(path)}</h1><p>{html.escape(summary)}</p>"
            f"{images}</body></html>")


def write_report(path: str, output: str, storage_options: dict | None = None) -> None:
    """Render the report, then write it: a dataset that cannot be read leaves no file."""
    check_output_folder(output)
    page = render_report(path, storage_options)
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as err:
        raise ConfigError(f"-o {output}: cannot write ({err.strerror or err})") from None


def check_output_folder(output: str) -> None:
    """``-o``'s folder exists: said before the work, not after it."""
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise ConfigError(f"-o {output}: the folder {folder} does not exist")
