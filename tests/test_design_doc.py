"""docs/DESIGN.md keeps up with the code: every status, raw column, stage-3 column, sample
json field and output folder or file name the code defines is documented there, with the
column types the code declares, and the doc's tables list nothing the code no longer has.

Pure and cheap: reads the doc and the package's own source, imports only records and
shards/storage (pyarrow, fsspec), never Ray.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pyarrow as pa
import pytest

from pairforge import records
from pairforge.records import (
    CLASSIFIER_SCORE_TYPE,
    PROCESS_COLUMNS,
    RAW_COLUMNS,
    SAMPLE_FIELDS,
    TOKEN_FIELDS,
    Status,
)
from pairforge.shards import storage

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
PACKAGE = ROOT / "pairforge"
CLASSIFIER_SCORE = "NAME_score"  # how the doc names a classifier's score column
# Module-level names of output folders and files in modules that write under OUT.
OUTPUT_NAME = re.compile(r"(?:_FOLDER|_FILE|_STATS)$")


def section(number: int) -> str:
    """The text of DESIGN.md's ``## N.`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {number}\.(.*?)(?=^## |\Z)", DESIGN, re.S | re.M)
    assert match, f"DESIGN.md has no section {number}"
    return match.group(1)


def table(heading: str) -> dict[str, list[str]]:
    """First cell (a `name`) -> the other cells, of the first table under ``### heading``."""
    match = re.search(rf"^### {re.escape(heading)}\n(.*?)(?=^#|\Z)", DESIGN, re.S | re.M)
    assert match, f"DESIGN.md has no subsection '### {heading}'"
    rows: dict[str, list[str]] = {}
    lines = [line for line in match.group(1).splitlines() if line.startswith("|")]
    assert len(lines) > 2, f"'### {heading}' has no table"
    for line in lines[2:]:  # past the header and its --- line
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.fullmatch(r"`([^`]+)`", cells[0])
        assert name, f"'### {heading}': first cell {cells[0]!r} is not a `name`"
        rows[name.group(1)] = cells[1:]
    return rows


def type_name(dtype: pa.DataType) -> str:
    """Arrow types as the doc writes them: int32, float32, list<uint64>, ..."""
    if pa.types.is_list(dtype):
        return f"list<{type_name(dtype.value_type)}>"
    return {"float": "float32", "double": "float64"}.get(str(dtype), str(dtype))


def check_types(rows: dict[str, list[str]], declared: dict[str, pa.DataType]) -> None:
    wrong = {name: (rows[name][0], type_name(dtype)) for name, dtype in declared.items()
             if rows[name][0] != f"`{type_name(dtype)}`"}
    assert not wrong, f"DESIGN.md types differ from records.py (doc, code): {wrong}"


def test_every_status_is_documented_and_nothing_else() -> None:
    documented = table("3.4 Statuses")
    code = {s.value for s in Status}
    stale, missing = set(documented) - code, code - set(documented)
    assert not stale, f"DESIGN.md 3.4 lists statuses the code does not have: {sorted(stale)}"
    assert not missing, f"statuses missing from DESIGN.md section 3.4: {sorted(missing)}"
    assert all(cells[0] and cells[1] for cells in documented.values()), \
        "every status needs who ends rows with it and what it means"


def test_raw_columns_are_documented_with_their_types() -> None:
    documented = table("3.1 Raw columns (stage 1)")
    declared = {f.name: f.type for f in RAW_COLUMNS}
    assert list(documented) == list(declared), \
        f"DESIGN.md 3.1 must list RAW_COLUMNS in order: {list(declared)}"
    check_types(documented, declared)


def test_stage3_columns_are_documented_with_their_types() -> None:
    documented = table("3.2 Stage-3 columns")
    declared = {**PROCESS_COLUMNS, CLASSIFIER_SCORE: CLASSIFIER_SCORE_TYPE}
    stale, missing = set(documented) - set(declared), set(declared) - set(documented)
    assert not stale, f"DESIGN.md 3.2 lists columns the code does not have: {sorted(stale)}"
    assert not missing, f"PROCESS_COLUMNS missing from DESIGN.md section 3.2: {sorted(missing)}"
    check_types(documented, declared)
    assert records.classifier_columns("NAME") == {CLASSIFIER_SCORE: CLASSIFIER_SCORE_TYPE}


def test_sample_json_fields_are_documented() -> None:
    text = section(3)
    missing = [f for f in SAMPLE_FIELDS + TOKEN_FIELDS if f"`{f}`" not in text]
    assert not missing, f"sample json fields missing from DESIGN.md section 3: {missing}"


def _writes_under_out(tree: ast.Module) -> bool:
    """Whether a module imports shards/storage, i.e. writes files under OUT."""
    return any(isinstance(node, ast.ImportFrom) and node.module == "pairforge.shards.storage"
               for node in ast.walk(tree))


@functools.cache
def output_names() -> dict[str, str]:
    """``module.NAME`` -> value of every output folder/file name: storage.py's constants
    and the ``*_FOLDER``/``*_FILE``/``*_STATS`` strings of modules that write under OUT."""
    names = {f"storage.{n}": getattr(storage, n) for n in dir(storage)
             if n.endswith("_FOLDER") or n == "MANIFEST"}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "pairforge.shards.storage" not in source:  # parse only the candidates
            continue
        tree = ast.parse(source)
        if not _writes_under_out(tree):
            continue
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and OUTPUT_NAME.search(node.targets[0].id)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                names[f"{path.stem}.{node.targets[0].id}"] = node.value.value
    return names


def test_output_names_are_known_here() -> None:
    """The scan itself finds the folders and files it is meant to guard."""
    found = set(output_names().values())
    assert {"raw", "dedup", "clip", "embeddings", "shards", "manifest.json", "logs",
            "recaption_cache", "duplicates.parquet", "dedup_stats.json"} <= found


@pytest.mark.parametrize("name", sorted(output_names()))
def test_output_folder_or_file_is_documented(name: str) -> None:
    value = output_names()[name]
    text = section(4)
    pattern = re.escape(value) if "." in value else rf"(?<![\w.-]){re.escape(value)}/"
    assert re.search(pattern, text), \
        f"{name} = {value!r} is written under OUT but DESIGN.md section 4 does not name it"
