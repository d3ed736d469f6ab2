"""Dependencies point one way (docs/ARCHITECTURE.md "Package dependencies").

Every module's imports are read with ``ast`` (function-level and TYPE_CHECKING imports included) and
checked against the allowed edges between packages below; a violation fails naming the file, the
line and the edge. The router and the kvstore run no model: the module-level imports of each of their
modules, followed transitively through the repository, must never reach torch, triton or kernels
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
    "kernels": set(),
    "services.common": set(),
    "services.engine": {"services.common", "kernels"},
    "services.worker": {"services.common", "services.engine"},
    "services.prefill": {"services.common", "services.engine", "services.worker"},
    "services.decode": {"services.common", "services.engine", "services.worker"},
    # The router runs no model: the engine modules it uses must be torch-free (checked below).
    "services.router": {"services.common", "services.engine"},
    "services.kvstore": {"services.common"},
}
"""Package -> the other packages its modules may import."""

NO_MODEL = ("services.router", "services.kvstore")
HEAVY = ("torch", "triton", "kernels")


def package_of(module: str) -> str | None:
    """The checked unit a module belongs to: a tool, a services.X package, kernels; None otherwise."""
    for tool in TOOLS:
        if module == tool or module.startswith(tool + "."):
            return tool
    parts = module.split(".")
    if parts[0] == "kernels":
        return "kernels"
    if parts[0] == "services" and len(parts) > 1:
        return "services." + parts[1]
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    """Every module of services/ and kernels/ except the generated protos."""
    files = [*ROOT.glob("services/**/*.py"), *ROOT.glob("kernels/**/*.py")]
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
    """An import chain from ``module`` to torch/triton/kernels through module-level imports, or None."""
    return _heavy_path(module, frozenset())


def _heavy_path(module: str, seen: frozenset[str]) -> tuple[str, ...] | None:
    for name, _ in imports(module, module_level_only=True):
        for loaded in _with_parents(name):
            if loaded.split(".")[0] in HEAVY:
                return (module, loaded)
            if loaded in MODULES and loaded not in seen and loaded != module:
                sub = _heavy_path(loaded, seen | {module})
                if sub is not None:
                    return (module, *sub)
    return None


def test_modules_found() -> None:
    assert {"services.common.server", "services.engine.engine", "services.worker.engine_service",
            "services.router.dispatch", "services.kvstore.servicer", "kernels"} <= MODULES.keys()


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
    """The checker itself: a kvstore module importing the engine and the router reaching torch."""
    assert package_of("services.engine.async_engine") not in ALLOWED["services.kvstore"]
    assert heavy_path("services.engine.model_loader") is not None
    assert heavy_path("services.engine.model_source") is None
    assert heavy_path("services.worker.engine_service") is not None
