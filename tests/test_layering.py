"""The architecture's rules, read from the source (docs/ARCHITECTURE.md): no import circles among the
project's modules, ``engine`` never imports ``studio`` (nor UI, HTTP or database libraries), and the
model-training tools stay out of both libraries.

Every ``import`` counts, at module level, inside a function (a lazy import is still a dependency) or
under ``if TYPE_CHECKING:`` (a typing-only import still ties the two modules: one is written against the
other, and a circle of them is a design circle even if it never runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "studio", "tools")
# What the engine must not use: UI, HTTP and database code lives in the studio.
ENGINE_FORBIDDEN = ("studio", "tools", "gradio", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts and "versions" in path.parts:
                continue  # Alembic loads these by file, not by import
            modules[module_name(path)] = path
    return modules


def imported_names(
    path: Path, module: str, known: set[str] | frozenset[str] = frozenset()
) -> list[tuple[str, int]]:
    """Every absolute module name ``path`` imports, with its line (``known``: the project's modules)."""
    tree = ast.parse(path.read_text(), str(path))
    names: list[tuple[str, int]] = []
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                names.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".")
                    anchor = anchor[: len(anchor) - child.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` imports ``mod``.
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    names.append((full if full in known else base, child.lineno))
            visit(child)

    visit(tree)
    return names


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line}."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for name, line in imported_names(path, module, set(modules)):
            if name in modules and name != module:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm; the components with more than one module are the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in graph:
        if node not in index:
            connect(node)
    return found


def test_no_import_circles():
    graph = import_graph()
    circles = strongly_connected(graph)
    described = [
        " <-> ".join(c)
        + ": "
        + "; ".join(f"{a} imports {b} (line {graph[a][b]})" for a in c for b in graph[a] if b in c)
        for c in circles
    ]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_engine_stays_a_library():
    """``engine`` imports neither the studio nor UI, HTTP or database libraries (lazily included)."""
    breaches = []
    for module, path in project_modules().items():
        if module.split(".")[0] != "engine":
            continue
        for name, line in imported_names(path, module):
            if name.split(".")[0] in ENGINE_FORBIDDEN:
                breaches.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not breaches, "engine/ must not import these:\n" + "\n".join(breaches)


def test_libraries_do_not_import_the_tools():
    breaches = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for module, path in project_modules().items()
        if module.split(".")[0] in ("engine", "studio")
        for name, line in imported_names(path, module)
        if name.split(".")[0] == "tools"
    ]
    assert not breaches, "\n".join(breaches)


def test_the_checker_sees_a_circle_and_a_breach(tmp_path, monkeypatch):
    """The rules above can fail: a planted circle and a planted engine -> studio import are both found."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "engine" / "a.py").write_text("from engine import b\n")
    (tmp_path / "engine" / "b.py").write_text("def f():\n    import engine.a\n    from studio import x\n")
    (tmp_path / "studio" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import studio.y\n"
    )
    (tmp_path / "studio" / "y.py").write_text("import studio.x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = import_graph()
    # studio.x imports studio.y for typing only: a circle all the same.
    assert sorted(strongly_connected(graph)) == [["engine.a", "engine.b"], ["studio.x", "studio.y"]]
    assert "studio.x" in graph["engine.b"]
