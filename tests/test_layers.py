"""The layers point one way (docs/architecture.md): every import in the library, at any depth
(function-level and ``TYPE_CHECKING`` ones too), goes to its own layer or a lower one, never
sideways between ``read`` and ``write``, and no set of modules imports itself round a circle.

Read from the source with ``ast``: nothing is imported, so a lazy import counts like any other.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {
    "crossfeed": ROOT / "crossfeed",
    "crossfeed.adapters": ROOT / "adapters",
    "crossfeed.beam_jobs": ROOT / "beam_jobs",
}

# lowest first; a module may import its own layer or any lower one. read and write share a rank
# but are siblings: neither imports the other. Inside net, streaming sits below leasing, and
# `connect` (which picks one of them) above both.
LAYERS = [
    ("crossfeed.errors", "crossfeed.policy", "crossfeed.config"),
    ("crossfeed.format",),
    ("crossfeed.io",),
    ("crossfeed.read", "crossfeed.write"),
    (
        "crossfeed.net.protocol",
        "crossfeed.net.addresses",
        "crossfeed.net.keys",
        "crossfeed.net.observe",
        "crossfeed.net.status",
    ),
    ("crossfeed.net.stream",),
    ("crossfeed.net.lease",),
    ("crossfeed.net.connect", "crossfeed.net"),
    ("crossfeed.metrics",),  # the Prometheus exporter: reads net's and read's counters
    ("crossfeed.adapters", "crossfeed.cli", "crossfeed.beam_jobs", "crossfeed.demo", "crossfeed"),
]
SIBLINGS = [("crossfeed.read", "crossfeed.write")]


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The library module ``name`` refers to (a package's module, or the package itself)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """Every library module ``module`` imports, anywhere in its source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            owner = _owner(name) if name.startswith("crossfeed") else None
            if owner and owner != module:
                found.add(owner)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def rank(module: str) -> tuple[int, str]:
    """``(layer, group)`` of a module: the most specific prefix in `LAYERS` that holds it."""
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (i, prefix)
    assert best is not None, f"{module} is in no layer; add it to LAYERS and docs/architecture.md"
    return best


def test_every_module_has_a_layer():
    for m in MODULES:
        rank(m)


def test_no_import_points_upward_or_sideways():
    bad = []
    for m, deps in sorted(GRAPH.items()):
        (lm, gm) = rank(m)
        for d in sorted(deps):
            (ld, gd) = rank(d)
            if ld > lm:
                bad.append(f"{m} (layer {lm}) imports {d} (layer {ld}): upward")
            elif ld == lm and gm != gd and any({gm, gd} == set(pair) for pair in SIBLINGS):
                bad.append(f"{m} imports its sibling {d}")
    assert not bad, "\n".join(bad)


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a circle."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_circles():
    assert _cycles() == []


@pytest.mark.parametrize(
    "src, dst",
    [("crossfeed.format.schema", "crossfeed.read.loader"), ("crossfeed.read.loader", "crossfeed.write.writer")],
)
def test_the_check_sees_a_planted_upward_import_and_a_circle(src, dst, monkeypatch):
    """The checks above are not vacuous: an upward (or sideways) edge and a circle are caught."""
    monkeypatch.setitem(GRAPH, src, GRAPH[src] | {dst})
    with pytest.raises(AssertionError, match="upward|sibling"):
        test_no_import_points_upward_or_sideways()
    monkeypatch.setitem(GRAPH, dst, GRAPH[dst] | {src})
    assert any(src in c and dst in c for c in _cycles())
