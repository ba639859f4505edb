"""``pairforge recaption-eval``: the recaption step on a table of references, per stratum.

A table (parquet, csv or jsonl) names an image (a local path), one or more reference
captions and any columns that split the images into strata (skin tone, age group,
region, background colour, ...). Every image is captioned by the configured backend through
the recaption step's own code (recaption/checked.py: cleaning, the attribute filter,
grounding, the strict retry, abstention), and each stratum gets:

* ``cider_d``: CIDEr-D of the captions against the references (recaption/cider.py), the
  document frequencies over the whole table; abstentions have no caption and are left out
  (they are counted by ``abstention``);
* ``hallucination``: the share of images for which a caption the model wrote (first try or
  strict retry) named an object noun grounding did not support (CHAIR's per-sentence rate,
  with grounding as the judge); null with grounding off;
* ``specificity``: object nouns per kept caption, all supported by grounding (a caption
  with an unsupported noun is never kept); null with grounding off;
* ``abstention``: the share of images left without a caption.

"A gap between strata is a launch blocker": per stratum column, the gap of a metric is the
largest difference between two strata with at least ``evaluation.min_rows`` rows, and a gap
past ``evaluation.max_gap`` fails the evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pairforge.config import ClipConfig, ConfigError, EvaluationConfig, RecaptionConfig

METRICS = ("cider_d", "hallucination", "specificity", "abstention")
FORMATS = ("parquet", "csv", "tsv", "jsonl", "json")  # json: a list of objects


@dataclass
class Row:
    """One image of the table, and what the recaption step made of it."""

    image: str  # as the table writes it
    path: Path  # where it is
    references: list[str]
    strata: dict[str, str]
    caption: str | None = None
    flags: tuple[str, ...] = ()
    cider_d: float | None = None
    hallucinated: bool | None = None
    nouns: int | None = None


# -- the table -------------------------------------------------------------------------------

def _read_arrow(path: Path) -> Any:
    """The table, read as the build reads input tables (pairforge/tables.py), except that
    csv/tsv cells stay text (strata such as "1", "2") and empty ones are null."""
    import fsspec

    from pairforge.tables import detect_format, read_table_file

    try:
        kind = detect_format(str(path))
    except ConfigError:
        kind = None
    if kind not in FORMATS:
        raise ConfigError(f"{path}: a table is {', '.join(FORMATS)} (got {path.suffix!r})")
    try:
        return read_table_file(fsspec.filesystem("file"), str(path), kind,
                               _text_columns(path, kind), empty_is_null=True)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"cannot read the table {path}: {err}") from None


def _text_columns(path: Path, kind: str) -> dict[str, Any]:
    import csv

    import fsspec
    import pyarrow as pa

    if kind not in ("csv", "tsv"):
        return {}
    with fsspec.open(str(path), "rt", compression="infer", newline="", encoding="utf-8") as f:
        names = next(csv.reader(f, delimiter="\t" if kind == "tsv" else ","), [])
    return {name: pa.string() for name in names}


def _references(value: Any) -> list[str]:
    if value is None:
        return []
    texts = value if isinstance(value, list) else [value]
    return [str(t).strip() for t in texts if t is not None and str(t).strip()]


def read_table(path: str | Path, cfg: EvaluationConfig, strata: list[str]) -> list[Row]:
    """The table's rows; ``ConfigError`` naming what is missing (columns, images,
    references)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"the reference table {path} is not a file")
    table = _read_arrow(path)
    needed = [cfg.image_col, *cfg.reference_cols, *strata]
    missing = [c for c in dict.fromkeys(needed) if c not in table.column_names]
    if missing:
        raise ConfigError(f"{path} has no column {', '.join(missing)} (its columns: "
                          f"{', '.join(table.column_names)}); name them with "
                          "evaluation.image_col, evaluation.reference_cols and --stratum")
    rows, problems = [], []
    for n, record in enumerate(table.to_pylist(), start=1):
        image = str(record[cfg.image_col] or "")
        local = Path(image) if Path(image).is_absolute() else path.parent / image
        refs = [r for col in cfg.reference_cols for r in _references(record[col])]
        if "://" in image or not local.is_file():
            problems.append(f"row {n}: {image!r} is not a local image file")
        elif not refs:
            problems.append(f"row {n}: no reference caption")
        rows.append(Row(image, local, refs, {c: str(record[c]) for c in strata}))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ConfigError(f"{path}: " + "; ".join(problems[:5]) + more)
    if not rows:
        raise ConfigError(f"{path} has no rows")
    return rows


# -- captioning and per-row measures ---------------------------------------------------------

def caption_rows(rc: RecaptionConfig, clip: ClipConfig, rows: list[Row],
                 progress: Callable[[int, int], None] | None = None) -> bool:
    """Caption every row with the recaption step's code (no cache: the model is what is
    measured; ``clip``: clip grounding's model); returns whether grounding ran."""
    from PIL import Image

    from pairforge.images import model_device
    from pairforge.recaption.checked import CheckedCaptioner

    checked = CheckedCaptioner(rc, clip, model_device(rc))
    for start in range(0, len(rows), rc.batch_size):
        batch = rows[start:start + rc.batch_size]
        images = [Image.open(row.path).convert("RGB") for row in batch]
        for row, entry in zip(batch, checked.caption_images(images), strict=True):
            row.caption, row.flags = entry.recaption, entry.flags
        if progress:
            progress(start + len(batch), len(rows))
    grounding = checked.grounding
    for row in rows:
        if grounding is not None:
            row.hallucinated = any(f.startswith(("regenerated:ungrounded:",
                                                 "abstained:ungrounded:")) for f in row.flags)
            row.nouns = len(grounding.lexicon.nouns(row.caption)) if row.caption else None
    _score(rows)
    return grounding is not None


def _score(rows: list[Row]) -> None:
    from pairforge.recaption.cider import cider_d

    # document frequencies over every row's references: the corpus is the whole table
    scores = cider_d([row.caption or "" for row in rows], [row.references for row in rows])
    for row, score in zip(rows, scores, strict=True):
        row.cider_d = score if row.caption else None


# -- per stratum -----------------------------------------------------------------------------

def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 4) if known else None


def measures(rows: list[Row]) -> dict[str, Any]:
    kept = [r for r in rows if r.caption]
    return {"rows": len(rows), "captions": len(kept),
            "cider_d": _mean([r.cider_d for r in kept]),
            "hallucination": _mean([float(r.hallucinated) if r.hallucinated is not None
                                    else None for r in rows]),
            "specificity": _mean([r.nouns for r in kept]),
            "abstention": round(1 - len(kept) / len(rows), 4)}


def _gaps(groups: dict[str, dict[str, Any]], cfg: EvaluationConfig) -> dict[str, Any]:
    counted = [m for m in groups.values() if m["rows"] >= cfg.min_rows]
    gaps = {}
    for metric in METRICS:
        values = [m[metric] for m in counted if m[metric] is not None]
        gaps[metric] = round(max(values) - min(values), 4) if len(values) > 1 else None
    return gaps


def summarize(rows: list[Row], strata: list[str], cfg: EvaluationConfig,
              bounds: dict[str, float | None]) -> dict[str, Any]:
    """Measures overall and per stratum, the gaps, and the gaps past their bounds."""
    result: dict[str, Any] = {"overall": measures(rows), "strata": {}, "bounds": bounds,
                              "min_rows": cfg.min_rows, "exceeded": []}
    for column in strata:
        values = sorted({row.strata[column] for row in rows})
        groups = {v: measures([r for r in rows if r.strata[column] == v]) for v in values}
        gaps = _gaps(groups, cfg)
        result["strata"][column] = {"groups": groups, "gap": gaps}
        for metric, gap in gaps.items():
            bound = bounds.get(metric)
            if gap is not None and bound is not None and gap > bound:
                result["exceeded"].append({"stratum": column, "metric": metric, "gap": gap,
                                           "bound": bound})
    result["samples"] = [{"image": r.image, **r.strata, "caption": r.caption,
                          "references": r.references, "flags": list(r.flags),
                          "cider_d": None if r.cider_d is None else round(r.cider_d, 4)}
                         for r in rows]
    return result


def parse_bounds(cfg: EvaluationConfig, overrides: list[str]) -> dict[str, float | None]:
    """evaluation.max_gap with ``METRIC=VALUE`` overrides (``none`` lifts a bound)."""
    bounds = cfg.max_gap.model_dump()
    for item in overrides:
        metric, sep, value = item.partition("=")
        if not sep or metric.strip() not in METRICS:
            raise ConfigError(f"--max-gap expects METRIC=VALUE with METRIC one of "
                              f"{', '.join(METRICS)} (got {item!r})")
        text = value.strip().lower()
        try:
            bounds[metric.strip()] = None if text in ("none", "null") else float(text)
        except ValueError:
            raise ConfigError(f"--max-gap {item}: {value!r} is not a number") from None
    return bounds


def verdict(result: dict[str, Any]) -> list[str]:
    """One line per gap past its bound."""
    return [f"{e['stratum']}: the {e['metric']} gap between strata is {e['gap']:g}, over "
            f"the bound {e['bound']:g}" for e in result["exceeded"]]


def tables(result: dict[str, Any]) -> list[Any]:
    """Rich tables: one per stratum column (and the overall row)."""
    from rich.table import Table

    def cells(m: dict[str, Any]) -> list[str]:
        return [f"{m['rows']}", *("-" if m[k] is None else f"{m[k]:.3f}" for k in METRICS)]

    out = []
    for column, data in result["strata"].items() or [("all", None)]:
        table = Table(title=f"captions by {column}", title_justify="left")
        for name in ("stratum", "rows", "CIDEr-D", "hallucination", "specificity",
                     "abstention"):
            table.add_column(name, justify="left" if name == "stratum" else "right")
        groups = data["groups"] if data else {}
        for value, m in groups.items():
            small = " (few rows)" if m["rows"] < result["min_rows"] else ""
            table.add_row(f"{value}{small}", *cells(m))
        table.add_row("all", *cells(result["overall"]), end_section=bool(data))
        if data:
            gap = data["gap"]
            table.add_row("gap", "", *("-" if gap[k] is None else f"{gap[k]:.3f}"
                                       for k in METRICS))
            bounds = result["bounds"]
            table.add_row("bound", "", *("-" if bounds[k] is None else f"{bounds[k]:g}"
                                         for k in METRICS))
        out.append(table)
    return out
