"""The package's modules import each other without a circle, counting imports inside functions
too (a circle held together by function-local imports is still one), and no module takes a private
name (one underscore) of another: what two modules share is public in one of them."""

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


def package_of(name: str, path: pathlib.Path) -> str:
    """The package that relative imports in module ``name`` start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def source_module(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads from, a relative one resolved against ``package``."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join([*anchor, base]) if base else ".".join(anchor)
    return base


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file: ``import a.b``, ``from a
    import b`` (``b`` a module, else ``a`` itself), relative imports resolved."""
    package = package_of(name, path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = source_module(node, package)
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


def private(name: str) -> bool:
    """One leading underscore: ``_x``, not a dunder such as ``__version__``."""
    return name.startswith("_") and not name.startswith("__")


def private_uses(package: str, source: str, known: set[str]) -> list[str]:
    """Where a module (in ``package``, its text ``source``) takes a private name of one of the
    ``known`` modules: ``from m import _x``, or ``m._x`` on a name bound to module ``m`` (``import
    m``, ``import m as a``, ``from p import m``; chains such as ``a.b._x`` too), anywhere in the
    file. A private module itself (``from . import _conv``) is no private name: its public names
    are what crosses."""
    tree = ast.parse(source)
    modules_named = {}  # local name -> the package module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is not None:
                    modules_named[alias.asname] = alias.name
                else:
                    modules_named[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = source_module(node, package)
            if base not in known:
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                if child in known:
                    modules_named[alias.asname or alias.name] = child
                elif private(alias.name):
                    found.append((node.lineno, f"from {base} import {alias.name}"))

    def module_of(expr) -> str | None:
        if isinstance(expr, ast.Name):
            bound = modules_named.get(expr.id)
            return bound if bound in known else None
        if isinstance(expr, ast.Attribute):
            parent = module_of(expr.value)
            if parent is not None and f"{parent}.{expr.attr}" in known:
                return f"{parent}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = module_of(node.value)
            if owner is not None and f"{owner}.{node.attr}" not in known:
                found.append((node.lineno, f"{owner}.{node.attr}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


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


def test_no_private_name_crosses_a_module_boundary():
    mods = modules()
    found = {name: private_uses(package_of(name, path), path.read_text(), set(mods)) for name, path in mods.items()}
    found = {name: uses for name, uses in found.items() if uses}
    assert not found, f"modules that take another module's private names (make them public there): {found}"


def test_the_private_name_walk_sees_what_it_must():
    known = {"p", "p.a", "p.b", "p._c", "p.d", "p.d.e"}
    source = """
import p.d
import p.a as alias
from p import b
from p.a import _helper, public, __version__
from . import _c
from .b import _relative
from p._c import _deep


def f(config):
    import p.d.e as inner

    b._one(alias._two, p.d.e._three, inner._four, _c._five, config._replace(x=1), b.public)
    return p._c.name, b.__doc__, alias.value._kept
"""
    assert private_uses("p", source, known) == [
        "line 5: from p.a import _helper",
        "line 7: from p.b import _relative",
        "line 8: from p._c import _deep",
        "line 14: p._c._five",
        "line 14: p.a._two",
        "line 14: p.b._one",
        "line 14: p.d.e._four",
        "line 14: p.d.e._three",
    ]
