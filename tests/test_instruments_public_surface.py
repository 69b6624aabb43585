"""Metrics and traces consume what the core passes them: no instrument reads or writes a lock
handle's private state (STYLE.md; issue 31, item 2)."""

from __future__ import annotations

import ast
from pathlib import Path

import django_keel_lock

PACKAGE = Path(django_keel_lock.__file__).parent
INSTRUMENTS = [PACKAGE / "metrics.py", *sorted((PACKAGE / "instruments").glob("*.py"))]


def _handle_params(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The parameters of `function` annotated as a lock handle (`Lock`)."""
    args = function.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    return {
        arg.arg
        for arg in every
        if arg.annotation is not None and ast.unparse(arg.annotation).split(".")[-1] == "Lock"
    }


def _private_uses(path: Path) -> list[str]:
    found = []
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        handles = _handle_params(function)
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in handles
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_instrument_reads_or_writes_a_handles_private_state() -> None:
    assert len(INSTRUMENTS) >= 4  # metrics.py, base.py, otel.py, prometheus.py
    used = [use for path in INSTRUMENTS for use in _private_uses(path)]
    assert used == [], f"instruments touch a handle's private state: {used}"
