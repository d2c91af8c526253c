"""Rules the source keeps so that a new maintainer can find their way: small functions, no
import circles, one exception tree.

Checked on the source itself (``ast`` and grimp, the graph import-linter builds), so they hold
for code that no other test imports.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "src" / "kvtether", *sorted((ROOT / "integrations").glob("*/src/*"))]
MAX_FUNCTION_LINES = 80
# Declarative tables: one statement per entry, nothing to split.
TABLES = {("router/metrics.py", "__init__")}
# Builtin exceptions a class may extend besides its kvtether base (ConfigError is a ValueError).
_BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                       if isinstance(value, type) and issubclass(value, BaseException)}


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _where(path: Path) -> str:
    for root in SOURCES:
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return str(path)


def test_no_function_is_longer_than_a_screen() -> None:
    long = [
        f"{_where(path)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
        and (_where(path), node.name) not in TABLES
    ]
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_the_function_length_check_sees_functions() -> None:
    tree = ast.parse("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES + 1))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    assert node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[operator]


@pytest.mark.skipif(
    importlib.util.find_spec("kvtether_langgraph") is None
    or importlib.util.find_spec("kvtether_openai_agents") is None,
    reason="the integrations are installed on Python >= 3.11 (make setup)",
)
@pytest.mark.parametrize("type_checking", [True, False], ids=["with-type-checking", "runtime"])
def test_no_import_circles(type_checking: bool) -> None:
    grimp = pytest.importorskip("grimp")  # import-linter's graph, in the dev extra
    graph = grimp.build_graph("kvtether", "kvtether_langgraph", "kvtether_openai_agents",
                              exclude_type_checking_imports=not type_checking, cache_dir=None)
    circles: set[tuple[str, ...]] = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back:
                circles.add(tuple(sorted({module, *back})))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in sorted(circles))


def _exception_classes() -> dict[str, tuple[str, list[str]]]:
    """Every class in the source whose bases lead to an exception: name -> (where, bases)."""
    bases: dict[str, tuple[str, list[str]]] = {}
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = [b.id if isinstance(b, ast.Name) else b.attr
                         for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))]
                bases[node.name] = (_where(path), names)

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in _BUILTIN_EXCEPTIONS or name == "BaseException":
            return True
        if name not in bases or name in seen:
            return False
        return any(is_exception(b, seen | {name}) for b in bases[name][1])

    return {name: info for name, info in bases.items()
            if not name.endswith("Warning") and is_exception(name)}


def test_every_public_exception_is_a_kvtether_error_named_error() -> None:
    classes = _exception_classes()

    def in_tree(name: str) -> bool:
        return name == "KVTetherError" or any(in_tree(b) for b in classes.get(name, ("", []))[1]
                                              if b in classes)

    outside = [f"{where}: {name}" for name, (where, _) in sorted(classes.items())
               if not name.startswith("_") and not (in_tree(name) and name.endswith("Error"))]
    assert not outside, "public exceptions outside KVTetherError (or not named ...Error):\n" + (
        "\n".join(outside))


def test_the_exception_check_sees_the_tree() -> None:
    classes = _exception_classes()
    assert {"KVTetherError", "ConfigError", "RouterHTTPError", "StoreError"} <= classes.keys()
