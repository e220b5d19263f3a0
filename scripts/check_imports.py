#!/usr/bin/env python3
"""Fails on any import circle among a Python package's modules (python/muond by default): every
import statement counts, at module level, inside functions and under ``if TYPE_CHECKING:`` alike;
an import names the module it reads (``from . import x`` of a name that is not a module reads the
package, its ``__init__``). A module's own packages, which Python runs before it, are not counted
as its imports. Generated code (``_proto``) is left out. scripts/test.sh runs it.

    scripts/check_imports.py [PACKAGE_DIR]

Exit 0 with no circle; 1 listing each circle's modules and the imports that close it.
"""

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

SKIPPED = {"_proto"}


def modules_of(package: Path) -> Dict[str, Path]:
    """Dotted name → file of every module and package under `package`."""
    root = package.parent
    found = {}
    for path in sorted(package.rglob("*.py")):
        if SKIPPED & set(path.relative_to(package).parts):
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, node: ast.AST, modules: Dict[str, Path]) -> List[str]:
    """The modules of `modules` that `node` (an import in module `name`) imports."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = []
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            full = f"{source}.{alias.name}"
            targets.append(full if full in modules else source)
    elif isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    out = []
    for target in targets:
        # The module it names, or the nearest package holding it (`from . import x` of a name, not
        # a module, reads the package).
        parts = target.split(".")
        if SKIPPED & set(parts):
            continue  # generated code imports nothing of the package's
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            out.append(".".join(parts))
    return [t for t in out if t != name]


def graph_of(modules: Dict[str, Path]) -> Dict[str, Set[str]]:
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(imported(name, path, node, modules))
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def main(argv: List[str]) -> int:
    package = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "python" / "muond"
    modules = modules_of(package)
    graph = graph_of(modules)
    found = circles(graph)
    if not found:
        print(f"imports: no circle among {len(modules)} modules of {package.name}")
        return 0
    for component in found:
        members = set(component)
        print(f"import circle among {len(component)} modules of {package.name}:")
        for name in component:
            inside = sorted(graph[name] & members)
            print(f"  {name} imports {', '.join(inside)}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
