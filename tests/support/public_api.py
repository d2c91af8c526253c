"""A static check that a package reads no other package's private names (its own are fine).

Used by each integration's tests: the integrations stand on the frameworks' public API only.
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["private_names_used_but_not_defined"]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names_used_but_not_defined(package: Path, own_prefix: str) -> list[str]:
    """Every ``_name`` the package's code reads that it does not define itself, and every
    private module or name it imports from another package."""
    trees = {path.name: ast.parse(path.read_text(), str(path)) for path in package.glob("*.py")}
    defined: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
    problems = []
    for file, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if node.attr not in defined:
                    problems.append(f"{file}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith(
                own_prefix
            ):
                module = node.module or ""
                names = [alias.name for alias in node.names]
                if any(_private(part) for part in module.split(".")) or any(map(_private, names)):
                    problems.append(f"{file}:{node.lineno}: from {module} import {names}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if any(_private(part) for part in alias.name.split(".")):
                        problems.append(f"{file}:{node.lineno}: import {alias.name}")
    return problems
