"""The package's import structure: no cycle anywhere, and the exl3 package layered one way.

The module-level import graph is read from the source (ast), so a cycle is found whether or not Python would
trip on it at run time; each exl3 module is also imported alone in a fresh interpreter, where an import that
only works after another module happens to be loaded fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import glm53_overlay

PACKAGE = Path(glm53_overlay.__file__).parent
# exl3, top to bottom: a module may import only modules below it (vLLM only in the first two).
EXL3_LAYERS = (
    ("config",),
    ("moe",),
    ("gpu_checks",),
    ("runtime",),
    ("mcg4_moe", "prefill_moe"),
    ("packing", "writer", "vectors", "prefill_gemm"),
    ("reference",),
    ("codebook", "trellis", "hadamard", "dense"),
)
VLLM_ALLOWED = {"glm53_overlay.exl3.config", "glm53_overlay.exl3.moe"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, *, top_level: bool) -> set[str]:
    """glm53_overlay modules (and 'vllm') imported by `module`: at module level, or inside functions."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if n is not f}
    type_checking = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and "TYPE_CHECKING" in ast.unparse(b.test)
                     for n in ast.walk(b)}
    for node in ast.walk(tree):
        if id(node) in type_checking or (id(node) in in_function) == top_level:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "vllm":
                found.add("vllm")
            elif name in MODULES and name != module:
                found.add(name)
    return found


def test_no_import_cycle_at_module_level() -> None:
    graph = {m: imports(m, top_level=True) - {"vllm"} for m in MODULES}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])


def test_exl3_imports_only_downwards() -> None:
    rank = {f"glm53_overlay.exl3.{name}": level for level, names in enumerate(EXL3_LAYERS) for name in names}
    assert set(rank) | {"glm53_overlay.exl3"} == {m for m in MODULES if m.startswith("glm53_overlay.exl3")}
    for module, level in rank.items():
        deps = imports(module, top_level=True)
        if "vllm" in deps:
            assert module in VLLM_ALLOWED, f"{module} imports vLLM at module level"
        for dep in deps - {"vllm"}:
            if dep.startswith("glm53_overlay.exl3."):
                assert rank[dep] > level, f"{module} imports {dep}, which is not below it"


def test_exl3_imports_nothing_of_its_own_inside_functions() -> None:
    # Lazy imports there would hide a cycle; heavy optional ones (exllamav3, torch's JIT) stay allowed.
    for module in (m for m in MODULES if m.startswith("glm53_overlay.exl3.")):
        assert not {d for d in imports(module, top_level=False) if d.startswith("glm53_overlay.")}, module


def _import_alone(module: str) -> tuple[str, int, str]:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    return module, done.returncode, done.stderr[-2000:]


def test_each_exl3_module_imports_alone_in_a_fresh_interpreter() -> None:
    modules = sorted(m for m in MODULES if m.startswith("glm53_overlay.exl3"))
    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = [(m, err) for m, rc, err in pool.map(_import_alone, modules) if rc]
    assert not failed, failed
