"""The one-way stack, read from the source (AST, so function-local imports count too).

format <- layout <- io <- commit <- saving / loading <- api <- training <- cli <- reshard.
A module may import its own layer and the layers below; ``saving`` and ``loading`` are peers
that never import each other; no two modules import each other through any chain; no module
imports a project module inside a function (a cycle in disguise).
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("shardfmt.errors", "shardfmt._version")),
    ("format", ("shardfmt.format",)),
    ("layout", ("shardfmt.layout",)),
    ("io", ("shardfmt.io",)),
    ("commit", ("shardfmt.commit",)),
    ("save/load", ("shardfmt.saving", "shardfmt.loading")),
    ("api", ("shardfmt.api", "shardfmt.validation", "shardfmt.dcp")),  # dcp: the DCP storage backend's home
    ("training", ("shardfmt.training",)),
    ("cli", ("shardfmt", "shardfmt.cli", "shardfmt.demo")),
    ("reshard", ("reshard",)),
)
PEERS = frozenset({("shardfmt.saving", "shardfmt.loading"), ("shardfmt.loading", "shardfmt.saving")})


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in ("shardfmt", "reshard"):
        for p in sorted((REPO / pkg).rglob("*.py")):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _group(mod: str) -> tuple[int, str]:
    """Return (layer index, the layer entry that owns ``mod``: the longest matching prefix)."""
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and (best is None or len(pre) > len(best[1])):
                best = (i, pre)
    assert best is not None, f"{mod} is in no layer of LAYERS: add it to the table"
    return best


def _absolute(mod: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _project(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _lazy_import(node: ast.AST) -> bool:
    """``importlib.import_module("<a literal>")`` or ``deferred("<a literal>", ...)`` (the command
    lines' commands): counted as the import it defers (its layer and cycles are checked; it is no
    function-local import: it is how a module is loaded late)."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    return (func in ("import_module", "deferred") and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str))


def _imports(mod: str, path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """Every project module ``mod`` imports: (module, line, inside a function)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = _absolute(mod, path, node)
            names = [f"{base}.{a.name}" for a in node.names] if base else []
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif _lazy_import(node):  # importlib.import_module("pkg.mod"): an import made at first use
            names = [node.args[0].value]
            node_inner = False
            for n in names:
                target = _project(n)
                if target and target != mod:
                    out.append((target, node.lineno, node_inner))
            continue
        for n in names:
            target = _project(n)
            if target and target != mod:
                out.append((target, node.lineno, id(node) in inner))
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_is_in_a_layer():
    for mod in MODULES:
        _group(mod)


def test_each_layer_imports_only_itself_and_below():
    bad = []
    for mod, deps in GRAPH.items():
        layer, group = _group(mod)
        for dep, line, _ in deps:
            dep_layer, dep_group = _group(dep)
            if dep_layer > layer or (group, dep_group) in PEERS:
                bad.append(f"{MODULES[mod].relative_to(REPO)}:{line}: {mod} ({LAYERS[layer][0]}) "
                           f"imports {dep} ({LAYERS[dep_layer][0]})")
    assert not bad, "imports against the layer table:\n" + "\n".join(bad)


def test_no_function_local_imports_of_project_modules():
    bad = [f"{MODULES[m].relative_to(REPO)}:{line}: imports {dep} inside a function"
           for m, deps in GRAPH.items() for dep, line, local in deps if local]
    assert not bad, "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_cycles_between_files():
    edges = {m: {d for d, _, _ in deps} for m, deps in GRAPH.items()}
    assert _cycles(edges) == []


def test_shardfmt_never_imports_reshard():
    bad = [(m, d) for m, deps in GRAPH.items() for d, _, _ in deps
           if m.startswith("shardfmt") and d.startswith("reshard")]
    assert bad == []


def test_the_checker_sees_a_violation():
    """The layer check is not vacuous: a made-up upward import is reported."""
    assert _group("shardfmt.format.manifest")[0] < _group("shardfmt.training.checkpointer")[0]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert ("shardfmt.saving", "shardfmt.loading") in PEERS
