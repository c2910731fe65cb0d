"""The package's layering, read from the source (imports inside functions included, since that is
where cycles hide): no import runs back up the layers, peers of one layer do not import each
other, and the module graph has no cycle. docs/architecture.md draws the same picture."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "llmweb"

# Lower layers never import higher ones. Packages in one layer are peers: they import only
# themselves and the layers below.
LAYERS: list[set[str]] = [
    {"errors"},
    {"records"},
    {"config"},
    {"engine", "retrieval", "store"},
    {"chat"},
    {"runtime"},
    {"web", "bench"},
    {"cli"},
    {"__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every llmweb module `name` imports, at any depth of its code."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the module pkg.sub where there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("llmweb") and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {n: imports_of(n, p, set(mods)) for n, p in mods.items()}


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(name: str) -> int:
    t = top(name)
    for i, names in enumerate(LAYERS):
        if t in names:
            return i
    raise AssertionError(f"{name}: its package {t!r} is in no layer; add it to LAYERS and docs/architecture.md")


def test_every_module_is_in_a_layer():
    for name in graph():
        if name != "llmweb":
            layer(name)


def test_no_import_runs_up_the_layers_or_across_peers():
    wrong = []
    for name, deps in graph().items():
        if name == "llmweb":
            continue
        for dep in deps:
            if dep == "llmweb" or top(dep) == top(name):
                continue
            if layer(dep) >= layer(name):
                wrong.append(f"{name} -> {dep}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (c := visit(m)):
                return c
        path.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_the_module_graph_has_no_cycle():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()) or [])


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The checks can fail: a made-up graph with a cycle is caught, and the real graph's edges are
    read from function-level imports too (runtime imports the chat module inside a method)."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    g = graph()
    assert "llmweb.engine.backends" in g["llmweb.runtime"], "function-level imports are counted"
    assert layer("llmweb.web.ui") > layer("llmweb.chat.session") > layer("llmweb.store.db")


# -- sizes: a class a newcomer can read, a function that fits a screen ---------------------------

MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
STEPWISE = "# stepwise:"  # on the line above a long pure function that reads as numbered steps


def oversized() -> list[str]:
    """Classes over MAX_CLASS_LINES and functions over MAX_FUNCTION_LINES, except functions marked
    stepwise (a comment on the line above the def, or above its decorators)."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), str(path))):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            marked = first >= 2 and lines[first - 2].strip().startswith(STEPWISE)
            where = f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({size} lines)"
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                out.append("class " + where)
            elif not isinstance(node, ast.ClassDef) and size > MAX_FUNCTION_LINES and not marked:
                out.append("def " + where)
    return out


def test_no_class_over_300_lines_and_no_function_over_80():
    assert not oversized(), "split these along their seams:\n" + "\n".join(oversized())
