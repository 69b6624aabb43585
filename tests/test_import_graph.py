"""The package's modules import one another without cycles, counting the imports inside
functions (not those under TYPE_CHECKING) and the packages an import runs first, and none
imports another's `_private` name."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import django_keel_lock

PACKAGE = Path(django_keel_lock.__file__).parent
NAME = "django_keel_lock"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(path): path for path in PACKAGE.rglob("*.py") if "migrations" not in path.parts
}


def imports(module: str) -> Iterator[tuple[str, str]]:
    """(the module of ours each import statement of `module` runs, the name it takes or "")."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for each in ast.walk(tree)
        if isinstance(each, ast.If) and "TYPE_CHECKING" in ast.unparse(each.test)
        for node in ast.walk(each)
    }
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                full = f"{source}.{alias.name}"
                yield (full, "") if full in MODULES else (source, alias.name)


def ours(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def packages_run(module: str, target: str) -> set[str]:
    """`target` and the packages above it that importing it from `module` may run first: those
    `module` is not inside (its own are already running), the root excepted."""
    run = {target}
    package = target.rpartition(".")[0]
    while package != NAME and not f"{module}.".startswith(f"{package}."):
        run.add(package)
        package = package.rpartition(".")[0]
    return run


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        targets = {ours(target) for target, _ in imports(module)}
        graph[module] = {
            each
            for target in targets
            if target is not None
            for each in packages_run(module, target)
            if each != module
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_in_the_package_counting_imports_inside_functions() -> None:
    graph = edges()
    assert graph[f"{NAME}.checks"] and graph[f"{NAME}.stores.redis.store"]  # the walk sees them
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_name() -> None:
    private = [
        f"{module} imports {name} from {target}"
        for module in MODULES
        for target, name in imports(module)
        if name.startswith("_") and not name.startswith("__") and ours(target) not in (None, module)
    ]
    assert private == []
