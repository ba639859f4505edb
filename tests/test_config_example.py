"""`pairforge config example` and `pairforge config check`: the example is generated from
the config models, reads back as the defaults, and the check says valid or names the key."""

from __future__ import annotations

import subprocess
import sys

import yaml

from pairforge.config import EXAMPLE_PLACEHOLDERS, PairforgeConfig, parse_config
from pairforge.config_example import example_yaml as _example_yaml


def example_yaml() -> str:
    return _example_yaml(PairforgeConfig, EXAMPLE_PLACEHOLDERS)


def example_config() -> PairforgeConfig:
    return PairforgeConfig.model_validate(EXAMPLE_PLACEHOLDERS)


def _keys(model: PairforgeConfig | object, prefix: str = "") -> list[str]:
    found = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        found.append(prefix + name)
        if hasattr(type(value), "model_fields"):
            found += _keys(value, f"{prefix}{name}.")
    return found


def test_the_example_reads_back_as_the_default_config() -> None:
    text = example_yaml()
    assert parse_config(yaml.safe_load(text)) == example_config()
    # every value is written out, as the default (not left for validation to fill in)
    assert yaml.safe_load(text) == example_config().model_dump(mode="json")


def test_every_key_is_in_the_example_with_its_description() -> None:
    text = example_yaml()
    lines = text.splitlines()
    for key in _keys(example_config()):
        leaf = key.rsplit(".", 1)[-1]
        depth = key.count(".")
        assert any(line.startswith("  " * depth + leaf + ":") for line in lines), key
    # a key's description is the comment just above it
    threads = lines.index("  threads: 32")
    description = PairforgeConfig.model_fields["download"].annotation.model_fields[
        "threads"].description
    assert lines[threads - 1] == f"  # {description}"


def test_config_check_says_valid_or_names_the_key(tmp_path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(example_yaml())
    run = [sys.executable, "-m", "pairforge.cli", "config", "check"]
    ok = subprocess.run([*run, str(good)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "valid" in ok.stdout
    bad = subprocess.run([*run, str(good), "--set", "download.thredas=4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "thredas" in bad.stdout + bad.stderr
    printed = subprocess.run([sys.executable, "-m", "pairforge.cli", "config", "example"],
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0 and printed.stdout == example_yaml()
