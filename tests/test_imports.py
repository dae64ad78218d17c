"""The product's imports flow one way: the front door and serving on top of codec and
diffusion, never back, and no module imports one that imports it (imports inside functions
count too). Read from the source, without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "auk_triton"
# Which of the package's parts each part may import.
MAY_IMPORT = {
    "codec": {"codec", "cuda_graph"},
    "diffusion": {"diffusion", "cuda_graph"},
    "serving": {"serving", "codec", "diffusion", "cuda_graph"},
    "front_door": {"front_door", "serving"},
    "cuda_graph": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def part(module: str) -> str | None:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else None


def test_each_part_imports_only_the_parts_below_it():
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items() if part(module) in MAY_IMPORT
        for target in targets if part(target) is not None and part(target) not in MAY_IMPORT[part(module)]
    ]
    assert not wrong, wrong


def test_no_module_imports_one_that_imports_it():
    graph = import_graph()
    # A package's __init__ re-exports its modules: an edge into the package itself is not a cycle.
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    cycles = []

    def visit(module: str, path: list[str], done: set[str]) -> None:
        for target in sorted(edges.get(module, ())):
            if target in path:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path + [target], done)
        done.add(module)

    done: set[str] = set()
    for module in sorted(edges):
        if module not in done:
            visit(module, [module], done)
    assert not cycles, cycles


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "auk_triton" / "codec" / "sample.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from .activation_kernel import fused_activation\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "auk_triton"
    try:
        found = imported_modules(source, {"auk_triton.codec.activation_kernel", "auk_triton.codec.sample"})
    finally:
        PACKAGE = saved
    assert found == {"auk_triton.codec.activation_kernel"}
