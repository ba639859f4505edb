"""A complete, commented YAML config, generated from the pydantic models of config.py.

``pairforge config example`` prints it for the root model: every key at its default, in
the models' order, each with its description (a section's: its class docstring's first
paragraph) as a comment above it; keys without a default get the placeholders the caller
passes (``config.EXAMPLE_PLACEHOLDERS``). Read back, the text is the default config
(tests/test_config_example.py), so it never drifts from the schema it is made from.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import yaml
from pydantic import BaseModel

_WIDTH = 88
_HEADER = ["# pairforge config: every key at its default (`pairforge config example`).",
           "# Change what you need; `pairforge config check FILE` validates a file.", ""]


def example_yaml(root: type[BaseModel], placeholders: dict[str, Any]) -> str:
    """``root``'s defaults (``placeholders`` where it has none) as YAML text, each key
    under its description."""
    config = root.model_validate(placeholders)
    lines = _HEADER + _section(config, config.model_dump(mode="json"), 0)
    return "\n".join(lines) + "\n"


def _section(model: BaseModel, dumped: dict[str, Any], depth: int) -> list[str]:
    lines: list[str] = []
    indent = "  " * depth
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        nested = isinstance(value, BaseModel)
        about = field.description or (_class_about(type(value)) if nested else "")
        if about:
            lines += _comment(about, indent)
        if nested:
            lines.append(f"{indent}{name}:")
            lines += _section(value, dumped[name], depth + 1)
        else:
            lines.append(f"{indent}{name}: {_scalar(dumped[name])}")
        if depth == 0:
            lines.append("")
    return lines


def _class_about(cls: type) -> str:
    """The first paragraph of the section class's own docstring (not one it inherits)."""
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, width=_WIDTH - len(indent), initial_indent=f"{indent}# ",
                         subsequent_indent=f"{indent}# ")


def _scalar(value: Any) -> str:
    """A value in YAML's flow style on one line (lists and mappings included)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False)
    return text.removesuffix("\n...\n").strip()
