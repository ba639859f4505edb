"""`pairforge inspect`: a dataset at a glance, from its manifest."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pairforge.inspection.cost import from_manifest
from pairforge.inspection.cost import lines as cost_lines
from pairforge.inspection.duplicates import summary_lines
from pairforge.records import STATUS_HELP, Status
from pairforge.shards.failures import breakdown_note, breakdown_rows
from pairforge.shards.storage import MANIFEST, OutputDir


def status_table(counts: dict[str, int], title: str) -> Table:
    total = sum(counts.values())
    table = Table(title=title, title_justify="left")
    table.add_column("status")
    table.add_column("rows", justify="right")
    table.add_column("share", justify="right")
    table.add_column("meaning", style="dim")
    ordered = sorted(counts.items(), key=lambda kv: (kv[0] != Status.OK, -kv[1], kv[0]))
    for status, n in ordered:
        meaning = STATUS_HELP.get(status, "")  # StrEnum keys hash like their strings
        table.add_row(status, f"{n:,}", f"{n / total:.1%}" if total else "-", meaning)
    table.add_row("[b]total[/b]", f"[b]{total:,}[/b]", "", "")
    return table


def _failures_table(manifest: dict[str, Any]) -> Group:
    """The hosts that lost the most rows in stage 1, with their statuses' meanings."""
    section = manifest.get("failures_by_host")
    table = Table(title="top hosts by failures (stage 1)", title_justify="left")
    for column in ("host", "failed", "status", "rows", "meaning"):
        table.add_column(column, justify="right" if column in ("failed", "rows") else "left",
                         style="dim" if column == "meaning" else None)
    for row in breakdown_rows(section):
        table.add_row(*[f"{v:,}" if isinstance(v, int) else v for v in row])
    note = breakdown_note(section)
    return Group(table, Text(note, style="dim")) if note else Group(table)


def _budget_table(manifest: dict[str, Any]) -> Table:
    tasks = manifest["totals"]["tasks"]
    image_total = sum(t["image_tokens"] for t in tasks.values()) or 1
    table = Table(title="token budget per task", title_justify="left")
    for column in ("task", "samples", "image tokens", "share", "caption tokens",
                   "sequence tokens"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for task, t in tasks.items():
        table.add_row(task, f"{t['samples']:,}", f"{t['image_tokens']:,}",
                      f"{t['image_tokens'] / image_total:.2%}", f"{t['caption_tokens']:,}",
                      f"{t['sequence_tokens']:,}")
    return table


def _shards_table(manifest: dict[str, Any], limit: int = 12) -> Table:
    table = Table(title=f"shards ({len(manifest['shards'])})", title_justify="left")
    for column in ("shard", "rows", "samples", "i2t share", "max prefix dev."):
        table.add_column(column, justify="left" if column == "shard" else "right")
    for shard in manifest["shards"][:limit]:
        budget = shard.get("budget") or {}
        table.add_row(shard["name"], f"{shard['rows']:,}", f"{shard['samples']:,}",
                      f"{budget['realized']:.3f}" if budget else "-",
                      f"{budget['max_prefix_deviation']:.0f}" if budget else "-")
    if len(manifest["shards"]) > limit:
        table.add_row(f"… {len(manifest['shards']) - limit} more", "", "", "", "")
    return table


def _classifier_line(entry: dict[str, Any]) -> str:
    label = f", label {entry['label']}" if entry.get("label") else ""
    bounds = [f"drop {side} {entry[key]:g}" for key, side in
              (("drop_above", "above"), ("drop_below", "below")) if entry.get(key) is not None]
    rule = f"{' and '.join(bounds)} -> {entry['status']}" if bounds else "score only"
    return (f"classifier {entry['name']}: {entry['backend']} {entry['model']}{label}; "
            f"{entry['score']}, {rule}; {entry['rows_dropped']:,} of {entry['rows_scored']:,} "
            "scored rows dropped")


def _models(manifest: dict[str, Any]) -> Text:
    vocab = manifest.get("vocab") or {}
    lines = [f"CLIP: {manifest['models'].get('clip') or 'not used'}"
             + (f" (threshold {manifest['models']['clip_threshold']:.4f})"
                if manifest["models"].get("clip_threshold") is not None else "")]
    lines += [_classifier_line(c) for c in manifest.get("classifiers") or []]
    recaption = manifest.get("recaption")
    if recaption:
        origin = ", ".join(f"{k} {v:,}" for k, v in recaption["origin"].items())
        source = ", ".join(f"{k} {v:,}" for k, v in recaption["caption_source"].items())
        lines.append(f"recaption: {manifest['models'].get('recaption')}; {recaption['rows']:,} "
                     f"rows ({origin}); abstained {recaption['abstained']:,}, failed "
                     f"{recaption.get('failed', 0):,}, attributes "
                     f"removed in {recaption['rows_with_attributes_removed']:,}, regenerated "
                     f"{recaption['regenerated']:,}; training caption: {source}")
    if manifest.get("steps"):  # the cost of the build per image and projected (cost.py)
        lines += [f"cost: {line}" for line in cost_lines(from_manifest(manifest))]
    if vocab:
        image, text = vocab["image_tokenizer"], vocab["text_tokenizer"]
        lines.append(f"image tokenizer: {image.get('backend')} {image.get('model')} "
                     f"(K={vocab['image_codebook_size']})")
        lines.append(f"text tokenizer: {text.get('backend')} {text.get('model')} "
                     f"(V_text={vocab['text_vocab_size']})")
        lines.append(f"vocabulary: SOV={vocab['sov']} EOV={vocab['eov']} EOS={vocab['eos']} "
                     f"PAD={vocab['pad']} total={vocab['total_size']}")
    return Text("\n".join(lines))


def inspect_view(path: str, storage_options: dict | None = None) -> Group:
    manifest = OutputDir(path, storage_options).read_json(MANIFEST)
    budget = manifest["budget"]
    funnel = manifest["funnel"]
    head = Text.assemble(
        (f"{path}\n", "bold"),
        f"{manifest['totals']['samples']:,} samples from {funnel['input_rows']:,} input rows; "
        f"p_drop {budget['p_drop']}, unconditional image-token share "
        f"{budget['realized_unconditional_share'] or 0:.4f} "
        f"(largest prefix deviation {budget['max_prefix_deviation_tokens'] or 0:.0f} tokens)")
    parts: list[Any] = [head, status_table(funnel["final"], "funnel (final status)"),
                        Text("\n".join(summary_lines(OutputDir(path, storage_options),
                                                     funnel["final"])))]
    if breakdown_rows(manifest.get("failures_by_host")) or breakdown_note(
            manifest.get("failures_by_host")):
        parts.append(_failures_table(manifest))
    if manifest["totals"]["tasks"]:
        parts.append(_budget_table(manifest))
    parts += [_shards_table(manifest), _models(manifest)]
    return Group(*parts)


def inspect_data(path: str, storage_options: dict | None = None) -> dict[str, Any]:
    """What ``inspect`` shows, as plain data for ``inspect --json``: the manifest's summary
    parts (the full config, vocabulary ids and per-shard budgets stay in manifest.json)."""
    manifest = OutputDir(path, storage_options).read_json(MANIFEST)
    shards = [{"name": s["name"], "rows": s["rows"], "samples": s["samples"],
               "i2t_share": (s.get("budget") or {}).get("realized")}
              for s in manifest["shards"]]
    return {"path": path, "samples": manifest["totals"]["samples"],
            "input_rows": manifest["funnel"]["input_rows"],
            "funnel": manifest["funnel"]["final"], "budget": manifest["budget"],
            "failures_by_host": manifest.get("failures_by_host"),
            "tasks": manifest["totals"]["tasks"], "shards": shards,
            "models": manifest["models"], "classifiers": manifest.get("classifiers") or [],
            "recaption": manifest.get("recaption"), "vocab": manifest.get("vocab"),
            "cost": from_manifest(manifest) if manifest.get("steps") else None}
