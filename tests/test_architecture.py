"""The layer rule of docs/ARCHITECTURE.md, checked on every module's imports.

Layers, lowest first: the ground floor (config, records, stage, images, retry, tables,
machine); the domain packages (filters, tokenizers, recaption, shards, train, sample,
scenes); pipeline (Ray orchestration); cli (verbs). A module may import its own layer and
those below it, never one above: a domain package that needs the pipeline has its logic in
the wrong place.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pairforge"
GROUND = {"config", "records", "stage", "images", "retry", "tables", "machine", "__init__"}
DOMAIN = {"filters", "tokenizers", "recaption", "shards", "train", "sample", "scenes"}
LAYERS = {"ground": 0, "domain": 1, "pipeline": 2, "cli": 3}


def layer_of(module: str) -> str:
    """The layer of a dotted module name inside pairforge."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in GROUND:
        return "ground"
    if top == "pipeline":
        return "pipeline"
    if top == "cli" or parts[-1] == "cli":
        return "cli"  # pairforge.cli and each package's own verbs (tokenizers.cli, ...)
    if top in DOMAIN:
        return "domain"
    raise AssertionError(f"{module}: a new top-level module needs a layer in ARCHITECTURE.md")


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "pairforge" or m.startswith("pairforge.")}


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts)


def test_no_module_imports_a_higher_layer() -> None:
    violations = []
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50
    for path in modules:
        name = module_name(path)
        own = LAYERS[layer_of(name)]
        for imported in imports_of(path):
            if LAYERS[layer_of(imported)] > own:
                violations.append(f"{name} imports {imported}")
    assert not violations, "\n".join(violations)


def test_the_rule_catches_an_upward_import(tmp_path) -> None:
    fake = tmp_path / "pairforge" / "filters" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from pairforge.pipeline.placement import add_steps\n")
    imported = imports_of(fake)
    assert imported == {"pairforge.pipeline.placement"}
    assert LAYERS[layer_of("pairforge.pipeline.placement")] > LAYERS[layer_of(
        "pairforge.filters.fake")]
