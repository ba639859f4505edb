"""The layer rule of docs/ARCHITECTURE.md, checked on every module's imports.

Layers, lowest first: the ground floor (config, records, stage, sources, images, batching,
backoff, tables, machine); the domain packages (download, dedup, filters, tokenizers,
recaption, shards, inspection, train, sample, scenes); pipeline and serve (Ray
orchestration, the service on Ray Serve); cli (verbs). A module may import its own layer and
those below it, never one above: a domain package that needs the pipeline has its logic in
the wrong place. Only pipeline/ and serve/ import Ray (the recaption step's claim registry, a
named actor, aside), and no module reaches itself through its imports, not even through an
import inside a function. Within the domain layer, shards/ (the files on disk) is the
bottom. No module is over 600 lines unless its docstring says why ("Over 600 lines
because ..."), no function over 60, and no module imports a test fixture from tests/.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pairforge"
GROUND = {"config", "config_example", "records", "stage", "sources", "images", "device_decode",
          "batching", "backoff", "tables", "machine", "__init__"}
DOMAIN = {"download", "dedup", "filters", "tokenizers", "recaption", "shards", "inspection",
          "train", "sample", "scenes"}
LAYERS = {"ground": 0, "domain": 1, "pipeline": 2, "cli": 3}


def layer_of(module: str) -> str:
    """The layer of a dotted module name inside pairforge."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in GROUND:
        return "ground"
    if top in ("pipeline", "serve"):  # serve/: the service on Ray Serve
        return "pipeline"
    if top == "cli" or parts[-1] == "cli":
        return "cli"  # pairforge.cli and each package's own verbs (tokenizers.cli, ...)
    if top in DOMAIN:
        return "domain"
    raise AssertionError(f"{module}: a new top-level module needs a layer in ARCHITECTURE.md")


# The Ray objects a domain package owns: the build's caption claim registry, and stage
# 1's host coordinators (named actors the shard tasks make and find by the run's id).
RAY_OUTSIDE_PIPELINE = {"pairforge.recaption.claims", "pairforge.recaption.step",
                        "pairforge.download.host_actors"}


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """Import nodes under ``if TYPE_CHECKING:``: never run, so neither layers nor cycles."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(n for body in node.body for n in ast.walk(body))
    return skipped


def all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function; ``from A import B``
    names ``A.B`` where that is a module of pairforge."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if _is_module(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def imports_of(path: Path) -> set[str]:
    return {m for m in all_imports(path) if m == "pairforge" or m.startswith("pairforge.")}


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "pairforge":
        return False
    base = PACKAGE.parent.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


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


def test_shards_is_the_bottom_of_the_domain_layer() -> None:
    """shards/ (the files on disk) imports no other domain package: they all read and write
    through it, so one of its imports would run up (a stage's own stats sections are added
    up by the stage, e.g. download/parts.py)."""
    upward = []
    for path in sorted((PACKAGE / "shards").rglob("*.py")):
        for imported in imports_of(path):
            top = imported.split(".")[1] if "." in imported else ""
            if layer_of(imported) == "domain" and top != "shards":
                upward.append(f"{module_name(path)} imports {imported}")
    assert not upward, "\n".join(upward)


def test_the_rule_catches_an_upward_import(tmp_path) -> None:
    fake = tmp_path / "pairforge" / "filters" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from pairforge.pipeline.placement import add_steps\n")
    imported = imports_of(fake)
    assert imported == {"pairforge.pipeline.placement"}
    assert LAYERS[layer_of("pairforge.pipeline.placement")] > LAYERS[layer_of(
        "pairforge.filters.fake")]
    fake.write_text("def late():\n    from pairforge.pipeline.placement import add_steps\n")
    assert imports_of(fake) == {"pairforge.pipeline.placement"}  # inside a function too



def test_nothing_below_pipeline_names_the_whole_config() -> None:
    """The ground floor and the domain packages are handed their own config sections
    (``DownloadConfig``, ..., a stage-3 step its ``StepConfig``), never ``PairforgeConfig``,
    not even for type checking: pipeline/ and serve's entry hand each part what it reads
    (``pipeline/contract.py``), so a part's settings are the ones it is given."""
    naming = [name for path in sorted(PACKAGE.rglob("*.py"))
              if layer_of(name := module_name(path)) in ("ground", "domain")
              and name != "pairforge.config" and "PairforgeConfig" in path.read_text()]
    assert naming == []


def test_the_executors_know_no_stage_and_no_domain_package_imports_them() -> None:
    """pipeline/executors.py runs any stage's tasks (bounded tasks, waves): it imports only
    the ground floor, and only pipeline/ imports it."""
    executors = PACKAGE / "pipeline" / "executors.py"
    assert {layer_of(m) for m in imports_of(executors)} <= {"ground"}
    importing = [module_name(path) for path in sorted(PACKAGE.rglob("*.py"))
                 if "pairforge.pipeline.executors" in imports_of(path)
                 and not module_name(path).startswith("pairforge.pipeline.")]
    assert importing == []

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
LONG_MODULE_REASON = "Over 600 lines because"


def test_no_module_over_600_lines_without_a_reason() -> None:
    """A long module says at its top why it is not split: a docstring line starting
    ``Over 600 lines because``."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines <= MAX_MODULE_LINES:
            continue
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if not any(line.startswith(LONG_MODULE_REASON) for line in docstring.splitlines()):
            unexplained.append(f"{module_name(path)}: {lines} lines")
    assert not unexplained, (f"modules over {MAX_MODULE_LINES} lines without a line "
                             f"'{LONG_MODULE_REASON} ...' in their docstring: {unexplained}")


def long_functions(source: str) -> list[tuple[str, int]]:
    """Every function or method (nested ones too) over MAX_FUNCTION_LINES lines, from its
    ``def`` to its last line: (name, lines)."""
    return [(node.name, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_over_60_lines() -> None:
    found = [f"{module_name(path)}.{name}: {lines} lines"
             for path in sorted(PACKAGE.rglob("*.py"))
             for name, lines in long_functions(path.read_text())]
    assert not found, "\n".join(found)


def test_the_length_check_counts_a_long_function() -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    source = f"def short():\n    pass\n\n\nclass A:\n    def long(self):\n{body}"
    assert long_functions(source) == []  # exactly the limit, def line included
    assert long_functions(source + "        x = 0\n") == [("long", MAX_FUNCTION_LINES + 1)]


def test_no_module_imports_the_tests() -> None:
    """Test fixtures (tiny random-weight models, loopback servers, references) live in
    tests/, and pairforge/ runs without them: no module imports one, not even inside a
    function."""
    fixtures = {path.stem for path in (PACKAGE.parent / "tests").glob("*.py")} | {"tests"}
    assert "tiny_models" in fixtures
    importing = [f"{module_name(path)} imports {imported}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for imported in all_imports(path) if imported.split(".")[0] in fixtures]
    assert not importing, "\n".join(importing)


def test_only_pipeline_imports_ray() -> None:
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if layer_of(name) == "pipeline" or name in RAY_OUTSIDE_PIPELINE:
            continue
        if any(m == "ray" or m.startswith("ray.") for m in all_imports(path)):
            outside.append(name)
    assert not outside, f"only pipeline/ may import Ray: {outside}"


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
