"""Dependencies point one way (docs/ARCHITECTURE.md "Package dependencies").

Every module's imports are read with ``ast`` (function-level and TYPE_CHECKING imports included) and
checked against the allowed edges between packages below; a violation fails naming the file, the
line and the edge. The router and the kvstore run no model: the module-level imports of each of their
modules, followed transitively through the repository, must never reach torch, triton or services.kernels
(tests/router/test_no_torch.py checks the same at run time).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TOOLS = ("services.cli", "services.launcher", "services.up", "services.process", "services.trace_capture")
"""Command-line tools that start or drive services: they may import any package; no package imports them."""

ALLOWED: dict[str, set[str]] = {
    "services.kernels": set(),
    "services.common": set(),
    # Text in and out of a model (tokenizer, detokenizer, sampling parameters): torch-free, for the router.
    "services.text": {"services.common"},
    "services.engine": {"services.common", "services.kernels", "services.text"},
    "services.worker": {"services.common", "services.engine", "services.text"},
    # KV connectors (services/kv): between the engine's page API and the services that hand pages over.
    "services.kv": {"services.common", "services.engine"},
    "services.prefill": {"services.common", "services.engine", "services.kv", "services.text", "services.worker"},
    "services.decode": {"services.common", "services.engine", "services.kv", "services.text", "services.worker"},
    # The router runs no model and imports nothing of the engine: what it reads of a model is in services.text.
    "services.router": {"services.common", "services.text"},
    "services.kvstore": {"services.common"},
}
"""Package -> the other packages its modules may import."""

NO_MODEL = ("services.router", "services.kvstore", "services.text")
HEAVY = ("torch", "triton", "services.kernels")


def package_of(module: str) -> str | None:
    """The checked unit a module belongs to: a tool, a services.X package; None otherwise."""
    for tool in TOOLS:
        if module == tool or module.startswith(tool + "."):
            return tool
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return "services." + parts[1]
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    """Every module of services/ (the kernels included) except the generated protos."""
    files = list(ROOT.glob("services/**/*.py"))
    return {module_name(p): p for p in files if "pb" not in p.relative_to(ROOT).parts}


MODULES = source_modules()


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The absolute names an import statement in ``module`` loads (a ``from`` of a submodule names it)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".")
        if not MODULES.get(module, Path()).name == "__init__.py":
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    names = [target]
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in MODULES:
            names.append(sub)
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, *, module_level_only: bool) -> list[tuple[str, int]]:
    """(imported name, line) of ``module``: every import statement, or (module level only) those that
    importing it runs at once (not in functions, classes or ``if TYPE_CHECKING:``)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    if not module_level_only:
        return [(name, node.lineno) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for name in _resolve(module, node)]
    found: list[tuple[str, int]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.extend((name, node.lineno) for name in _resolve(module, node))
            elif isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                    visit(block)
            elif isinstance(node, (ast.With, ast.For, ast.While)):
                visit(node.body)

    visit(tree.body)
    return found


def _with_parents(name: str) -> list[str]:
    """``a.b.c`` loads ``a``, ``a.b`` and ``a.b.c`` (each package's __init__ runs)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


@functools.cache
def heavy_path(module: str) -> tuple[str, ...] | None:
    """An import chain from ``module`` to torch/triton/services.kernels through module-level imports, or None."""
    return _heavy_path(module, frozenset())


def _heavy_path(module: str, seen: frozenset[str]) -> tuple[str, ...] | None:
    for name, _ in imports(module, module_level_only=True):
        for loaded in _with_parents(name):
            if loaded.split(".")[0] in HEAVY or loaded == "services.kernels" or loaded.startswith("services.kernels."):
                return (module, loaded)
            if loaded in MODULES and loaded not in seen and loaded != module:
                sub = _heavy_path(loaded, seen | {module})
                if sub is not None:
                    return (module, *sub)
    return None


def test_modules_found() -> None:
    assert {"services.common.server", "services.engine.engine", "services.worker.engine_service",
            "services.router.dispatch", "services.kvstore.servicer", "services.kernels"} <= MODULES.keys()


def test_packages_import_only_what_they_may() -> None:
    violations = []
    for module, path in sorted(MODULES.items()):
        src = package_of(module)
        if src is None or src in TOOLS:
            continue
        assert src in ALLOWED, f"{path}: package {src} has no entry in ALLOWED (add one, and to ARCHITECTURE.md)"
        for name, line in imports(module, module_level_only=False):
            dst = package_of(name)
            if dst is None or dst == src:
                continue
            if dst in TOOLS or dst not in ALLOWED[src]:
                violations.append(f"{path.relative_to(ROOT)}:{line}: {src} -> {dst} (imports {name})")
    assert not violations, "imports against the dependency direction:\n" + "\n".join(violations)


def test_processes_without_a_model_reach_no_torch() -> None:
    violations = []
    for module, path in sorted(MODULES.items()):
        if package_of(module) not in NO_MODEL:
            continue
        chain = heavy_path(module)
        if chain is not None:
            violations.append(f"{path.relative_to(ROOT)}: {' -> '.join(chain)}")
    assert not violations, "router/kvstore modules whose imports load torch:\n" + "\n".join(violations)


def test_the_checker_sees_violations() -> None:
    """The checker itself: a kvstore or router module importing the engine and the router reaching torch."""
    assert package_of("services.engine.async_engine") not in ALLOWED["services.kvstore"]
    assert package_of("services.engine.model_source") not in ALLOWED["services.router"]
    assert heavy_path("services.engine.model_loader") is not None
    assert heavy_path("services.text.model.source") is None
    assert heavy_path("services.worker.engine_service") is not None


# ---- module cycles and imports inside functions ----------------------------------------------------------

def runtime_imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported name, line, inside a function) of every import ``module`` can run: module level, class
    bodies and functions, but not ``if TYPE_CHECKING:`` blocks (types only, never executed)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit_stmt(sub, in_function)
                continue
            visit_stmt(child, in_function)

    def visit_stmt(child: ast.AST, in_function: bool) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.extend((name, child.lineno, in_function) for name in _resolve(module, child))
            return
        visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the repository modules its runtime imports load. A package's own ``__init__``, loaded
    implicitly when a submodule of it is imported, is not an edge of that submodule (a package gathering its
    children is not a cycle); importing a name from the package itself is."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        edges = graph.setdefault(module, set())
        for name, _, _ in runtime_imports(module):
            for loaded in _with_parents(name):
                implicit = loaded != name and module.startswith(loaded + ".")
                if loaded in MODULES and loaded != module and not implicit:
                    edges.add(loaded)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles_even_through_imports_inside_functions() -> None:
    found = cycles(import_graph())
    assert not found, "modules importing each other (an import inside a function counts too):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _comment_above(lines: list[str], i: int) -> bool:
    """Whether a comment line opens the block of import lines that line ``i`` (0-based) belongs to."""
    while i > 0 and (not lines[i - 1].strip() or lines[i - 1].strip().startswith(("from ", "import "))):
        i -= 1
    return i > 0 and lines[i - 1].strip().startswith("#")


def test_an_import_inside_a_function_says_why() -> None:
    """An intra-repository import inside a function hides a dependency from a reader of the module's head;
    each one carries a comment (on its line or the line above) saying why it cannot sit at the top: an
    optional or heavy dependency loaded only when used, a child process's priority, a command's start-up."""
    undocumented = []
    for module, path in sorted(MODULES.items()):
        lines = path.read_text().splitlines()
        for name, line, in_function in runtime_imports(module):
            if not in_function or package_of(name) is None:
                continue
            if "#" not in lines[line - 1] and not _comment_above(lines, line - 1):
                undocumented.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not undocumented, "imports inside functions without a comment saying why:\n" + "\n".join(
        sorted(set(undocumented)))
