"""The package's modules import each other without a circle, counting imports inside functions
too (a circle held together by function-local imports is still one)."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = {"naisnet_jax": REPO / "src" / "naisnet_jax", "naisnet_jax.verify": REPO / "verify"}


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (``verify/`` installs as ``naisnet_jax.verify``)."""
    found = {}
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if name.startswith("naisnet_jax.verify") and package == "naisnet_jax":
                continue  # a link to verify/ in an editable install
            found[name] = path
    return found


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file: ``import a.b``, ``from a
    import b`` (``b`` a module, else ``a`` itself), relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                out.add(child if child in known else base)
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def test_no_import_circle():
    found = cycles(graph())
    assert not found, f"modules that import each other in a circle: {found}"


def test_the_walk_sees_what_it_must():
    g = graph()
    assert "naisnet_jax.models.nais" in g and "naisnet_jax.verify.certify" in g
    assert "naisnet_jax.probe" in g["naisnet_jax.models.nais"]  # a module-level import
    assert "naisnet_jax.verify" in g["naisnet_jax.sweep"]  # an import inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
