"""Pins: what a reader or a compaction of the caption cache's index is using, kept from
cleanup (recaption/cache_index.py's ``commit``).

``index/pin-NAME-HOLDER.json`` (``{"name", "until"}``) says that NAME, a generation or
work folder under ``index/``, is in use until a wall-clock time: the holders run on other
machines than the committer. A reader renews its pin at half its life while it looks up;
a pin whose holder died lapses, and the next commit removes it and what it alone held.
"""

from __future__ import annotations

import contextlib
import time

from pairforge.shards.storage import OutputDir

INDEX_FOLDER = "index"  # under the identity folder: the index and its pins
PIN_S = 1800.0  # a reader's pin of its generation; renewed at half its life
COMPACTION_PIN_S = 6 * 3600.0  # a compaction's pins: it commits or fails within this


def pin(folder: OutputDir, name: str, holder: str, seconds: float = PIN_S) -> float:
    """Keep ``name`` (a folder under index/) from cleanup for ``seconds``; returns until
    when. Wall-clock time: the holders are on other machines than the committer."""
    until = time.time() + seconds
    folder.fs.makedirs(folder.path(INDEX_FOLDER), exist_ok=True)
    folder.write_json({"name": name, "until": until}, INDEX_FOLDER, f"pin-{name}-{holder}.json")
    return until


def unpin(folder: OutputDir, name: str, holder: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # lapsed and removed by a commit
        folder.fs.rm(folder.path(INDEX_FOLDER, f"pin-{name}-{holder}.json"))


def pinned(folder: OutputDir) -> set[str]:
    """The names live pins hold; lapsed pins are removed."""
    now, held = time.time(), set()
    for name in folder.glob(f"{INDEX_FOLDER}/pin-*.json"):
        try:
            entry = folder.read_json(INDEX_FOLDER, name)
        except FileNotFoundError:
            continue  # unpinned meanwhile
        if entry["until"] > now:
            held.add(entry["name"])
        else:
            unpin(folder, entry["name"], name[len(f"pin-{entry['name']}-"):-len(".json")])
    return held
