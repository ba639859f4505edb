"""Opening a built dataset for the verbs that read one (inspect, show, report, verify)."""

from __future__ import annotations

import os

from pairforge.config import ConfigError
from pairforge.shards.storage import MANIFEST, OutputDir


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


def check_output_folder(output: str) -> None:
    """``-o``'s folder exists: said before the work, not after it."""
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise ConfigError(f"-o {output}: the folder {folder} does not exist")
