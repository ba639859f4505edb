"""The documentation site keeps up with the code: every config key has a description, the
generated reference pages (docs/gen_reference.py) are what the code gives now, the site's
navigation names every page, every relative link and anchor in the docs and README.md
resolves, the train config reference shows the real defaults, and README.md stays a door
(at most 200 lines, the two commands, links into the site). Also: the list of tests that
`make test-fast` leaves out (tests/conftest.py) names tests that exist."""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest
import yaml

from pairforge.config import EXAMPLE_PLACEHOLDERS, PairforgeConfig
from pairforge.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _generator():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_every_config_key_has_a_description() -> None:
    keys = gen.all_keys(PairforgeConfig)
    assert len(keys) > 150  # every leaf, list entries' keys included
    missing = [key.path for key in keys if not key.description.strip()]
    assert missing == [], f"config keys without a description (Field(description=...)): {missing}"


def _leaves(model: object, prefix: str = "") -> list[str]:
    found = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if hasattr(type(value), "model_fields"):
            found += _leaves(value, f"{prefix}{name}.")
        else:
            found.append(prefix + name)
    return found


def test_the_config_reference_names_every_key_with_its_default() -> None:
    page = (DOCS / "reference" / "config.md").read_text()
    config = PairforgeConfig.model_validate(EXAMPLE_PLACEHOLDERS)
    leaves = _leaves(config)
    assert "download.image.max_output_pixels" in leaves
    absent = [key for key in leaves if f"| `{key}` |" not in page]
    assert absent == []
    # a list entry's keys too (process.classifiers is empty by default)
    assert "| `process.classifiers[].drop_above` |" in page
    row = next(line for line in page.splitlines() if line.startswith("| `download.threads` |"))
    assert "| `32` |" in row and "fetch threads per shard task" in row


def test_the_generated_reference_pages_are_up_to_date() -> None:
    assert gen.stale_pages() == [], "run: python docs/gen_reference.py"


def test_the_status_reference_has_every_status() -> None:
    from pairforge.records import Status

    page = (DOCS / "reference" / "statuses.md").read_text()
    assert [s.value for s in Status if f"| `{s.value}` |" not in page] == []
    assert "| `duplicate_near` | stage 2: dedup |" in page
    assert "| `timeout` | stage 1: download |" in page and page.count("| yes |") == 2


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_site_nav_names_every_page_and_only_pages_that_exist() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert "DESIGN.md" in nav and "ARCHITECTURE.md" in nav  # where other tests read them


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading (inline code marks dropped)."""
    text = re.sub(r"[`*]", "", heading).strip()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # no headings in code
    found = {_slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)}
    return found | set(re.findall(r'<a id="([^"]+)">', text))


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _documents() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("document", _documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(document: Path) -> None:
    text = re.sub(r"^```.*?^```", "", document.read_text(encoding="utf-8"), flags=re.M | re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists() or (anchor and resolved.suffix == ".md"
                                     and anchor not in _anchors(resolved)):
            broken.append(target)
    assert broken == []


def _train_leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_train_leaves(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_the_train_config_reference_shows_the_defaults() -> None:
    """Every value in the train config block is the default (but data.path, an example),
    and every key of the train config is in it."""
    page = (DOCS / "reference" / "train-config.md").read_text()
    shown = _train_leaves(yaml.safe_load(page.split("```yaml\n", 1)[1].split("```", 1)[0]))
    defaults = _train_leaves(TrainConfig(data={"path": "x"}).model_dump(mode="python"))
    wrong = {k: (v, defaults.get(k, "not a key")) for k, v in shown.items()
             if k != "data.path" and defaults.get(k, "absent") != v}
    assert wrong == {}
    assert sorted(set(defaults) - set(shown)) == []


def test_readme_is_a_door_into_the_site() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", text))
    # the guide a cluster user needs is one click away, and from it the models guide
    assert {"docs/guides/cluster.md", "docs/getting-started.md",
            "docs/reference/config.md"} <= linked
    assert "real-models.md" in (DOCS / "guides" / "cluster.md").read_text()


def test_the_fast_loop_leaves_out_only_tests_that_exist() -> None:
    """`make test-fast`'s list (tests/conftest.py) names files and tests that exist, so a
    renamed test cannot slip into the fast loop unnoticed; so does the order in which
    `make test` hands the longest files to its workers (a renamed file would go last)."""
    from conftest import FAST_LOOP_LEAVES_OUT, LONGEST_FIRST

    assert [p for p in LONGEST_FIRST if not (ROOT / p).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert "--no-loadscope-reorder" in (ROOT / "Makefile").read_text()

    missing = []
    for entries in FAST_LOOP_LEAVES_OUT.values():
        for entry in entries:
            path, _, name = entry.partition("::")
            source = ROOT / path
            if not source.is_file() or (name and f"def {name}(" not in source.read_text()):
                missing.append(entry)
    assert missing == []
    makefile = (ROOT / "Makefile").read_text()
    assert all(f"not {mark}" in makefile for mark in FAST_LOOP_LEAVES_OUT)
