"""The input plan a build records (``OUT/input_plan.json``), so that appending input files
to a finished build adds shards and moves none.

Without a record, shard ``k`` holds rows ``k·shard_size`` onwards of all inputs in sorted
order: a file added later would shift the ids of every shard after it, or fill the last,
shorter shard, whose stats already say it is complete (its new rows would never be
fetched). So the first run records its files in groups: each group's files, packed one
after another from the group's first shard id. A later run whose input matches more
files plans the earlier groups exactly as recorded and the new files as a new group,
starting a fresh shard after the last one; a recorded file that is gone or whose row
count changed stops the run before any work, naming the file (a file repaired in place,
with the same rows, is read as it is now, as before). The record binds once a raw shard
is complete: before that, and with another ``input.shard_size`` (stage 1's settings
check then stops the run or, with ``--redo-changed`` or ``--force``, redoes the shards),
the run plans afresh.

The record holds one entry per input file (a plan, like the shard list the driver holds
anyway), never rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pairforge.config import ConfigError
from pairforge.shards.raw import completed_shards
from pairforge.shards.storage import RAW_FOLDER, OutputDir

PLAN_FILE = "input_plan.json"
PLAN_VERSION = 1


def planned_shards(out: OutputDir, files: list[Any], shard_size: int,
                   shards_of: Any) -> Iterator[Any]:
    """The run's shards: the recorded groups as they were, then this run's new files
    (``files``: InputFile in input order); writes the record when it changes."""
    record = _read(out, shard_size)
    known = {entry["path"]: entry for group in record["groups"] for entry in group["files"]}
    current = {f.path: f for f in files}
    for path, entry in known.items():
        _check_unchanged(path, entry, current.get(path))
    new = [f for f in files if f.path not in known]
    if new:
        first = _next_shard(record, shard_size)
        record["groups"].append({"first_shard": first, "files": [
            {"path": f.path, "rows": f.rows} for f in new]})
        out.makedirs()
        out.write_json(record, PLAN_FILE)
    for group in record["groups"]:
        group_files = [current[e["path"]] for e in group["files"]]
        yield from shards_of(group_files, shard_size, group["first_shard"])


def _read(out: OutputDir, shard_size: int) -> dict[str, Any]:
    empty = {"plan_version": PLAN_VERSION, "shard_size": shard_size, "groups": []}
    if not out.exists(PLAN_FILE):
        return empty
    record = out.read_json(PLAN_FILE)
    if record.get("shard_size") != shard_size or record.get("plan_version") != PLAN_VERSION:
        return empty  # another shard size: every shard is another; stage 1's check decides
    if not completed_shards(out, RAW_FOLDER):
        return empty  # nothing made from the plan yet: the input may still change freely
    return record


def _check_unchanged(path: str, entry: dict[str, Any], file: Any | None) -> None:
    if file is None:
        raise ConfigError(
            f"input file {path} is in this build's input plan ({PLAN_FILE}) but no longer "
            "in input.path: a build takes new input files as new shards and keeps the "
            "earlier ones as they were. Restore it, or write to another output.path.")
    if file.rows != entry["rows"]:
        raise ConfigError(
            f"input file {path} changed since this build planned it ({entry['rows']:,} rows "
            f"then, {file.rows:,} now): its shards would no longer hold the rows their keys "
            "name. Restore it, add the new rows as a new file, or write to another "
            "output.path.")


def _next_shard(record: dict[str, Any], shard_size: int) -> int:
    """The id after the recorded groups' last shard."""
    if not record["groups"]:
        return 0
    last = record["groups"][-1]
    rows = sum(e["rows"] for e in last["files"])
    return last["first_shard"] + max(1, -(-rows // shard_size))
