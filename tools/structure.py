"""The package's structure from its AST: import graph, cycles, long functions, wide classes.

    python tools/structure.py                 # summary: modules, cycles, functions > 100 lines, classes > 30
                                              # methods, private names imported across modules
    python tools/structure.py --graph         # every module and the package modules it imports
    python tools/structure.py --layers        # imports between top-level packages (the map in docs/structure.md)
    python tools/structure.py --dot out.dot   # the graph for graphviz (one node per top-level package)

Imports count wherever they sit (module level or inside a function); imports under ``if TYPE_CHECKING:``
do not, since they never run. ``tests/test_structure.py`` holds the package to: no cycle, no function over
100 lines, no class over 30 methods.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ucp_store"
MAX_FUNCTION_LINES = 100
MAX_CLASS_METHODS = 30


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: set[str] = field(default_factory=set)
    deferred: set[str] = field(default_factory=set)  # the subset imported inside a function


@dataclass(frozen=True)
class Long:
    where: str
    name: str
    size: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import node, inside a function) for every import that runs (``TYPE_CHECKING`` blocks skipped)."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_func = stack.pop()
        for child in ast.iter_child_nodes(node):
            if _type_checking_block(child):
                stack.extend((c, in_func) for c in child.orelse)  # type: ignore[attr-defined]
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_func
            deeper = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            stack.append((child, deeper))


def _targets(node: ast.Import | ast.ImportFrom, me: str, is_pkg: bool, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = me.split(".") if is_pkg else me.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        names = [f"{stem}.{a.name}" for a in node.names] + [stem]
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != me:
            out.add(name)
    return out


def load_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Module]:
    paths = sorted((root / package).rglob("*.py"))
    mods = {module_name(p, root): Module(module_name(p, root), p, ast.parse(p.read_text(), str(p))) for p in paths}
    known = set(mods)
    for mod in mods.values():
        tree = mod.tree
        is_pkg = mod.path.name == "__init__.py"
        for node, in_func in _walk_imports(tree):
            found = _targets(node, mod.name, is_pkg, known)
            # ``from pkg import sub`` names the package too; the package's own __init__ is not an edge of
            # its submodules' (Python runs it anyway), so keep only the most specific target per import
            found = {t for t in found if not any(o != t and o.startswith(t + ".") for o in found)}
            mod.imports |= found
            if in_func:
                mod.deferred |= found
    return mods


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(mods):
        if start in index:
            continue
        work = [(start, iter(sorted(mods[start].imports)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(mods[nxt].imports))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def long_functions(mods: dict[str, Module], limit: int = MAX_FUNCTION_LINES) -> list[Long]:
    out = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > limit:
                    out.append(Long(mod.name, node.name, size))
    return sorted(out, key=lambda x: -x.size)


def wide_classes(mods: dict[str, Module], limit: int = MAX_CLASS_METHODS) -> list[Long]:
    out = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n > limit:
                    out.append(Long(mod.name, node.name, n))
    return sorted(out, key=lambda x: -x.size)


def private_imports(mods: dict[str, Module], package: str = PACKAGE) -> list[Long]:
    """``from ucp_store.x import _name``: a module reaching into another's private names (size 0)."""
    out = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
                out += [Long(mod.name, f"{node.module}.{a.name}", 0) for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return sorted(out, key=lambda x: (x.where, x.name))


def top(name: str, depth: int = 2) -> str:
    return ".".join(name.split(".")[:depth])


def layer_edges(mods: dict[str, Module]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for mod in mods.values():
        src = top(mod.name)
        for dst in mod.imports:
            if top(dst) != src:
                edges.setdefault(src, set()).add(top(dst))
    return edges


def summary(mods: dict[str, Module]) -> str:
    lines = []
    rel = sum(len(m.imports) for m in mods.values())
    deferred = sum(len(m.deferred) for m in mods.values())
    lines.append(f"modules: {len(mods)}; import edges: {rel}, of which inside functions: {deferred}")
    cyc = cycles(mods)
    lines.append(f"import cycles: {len(cyc)}")
    lines += [f"  {{{', '.join(c)}}}" for c in cyc]
    longs = long_functions(mods)
    lines.append(f"functions over {MAX_FUNCTION_LINES} lines: {len(longs)}")
    lines += [f"  {x.where}.{x.name}: {x.size}" for x in longs]
    wide = wide_classes(mods)
    lines.append(f"classes over {MAX_CLASS_METHODS} methods: {len(wide)}")
    lines += [f"  {x.where}.{x.name}: {x.size}" for x in wide]
    private = private_imports(mods)
    lines.append(f"private names imported from another module: {len(private)}")
    lines += [f"  {x.where} <- {x.name}" for x in private]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", action="store_true", help="every module and what it imports")
    ap.add_argument("--layers", action="store_true", help="imports between top-level packages")
    ap.add_argument("--dot", metavar="FILE", help="write the top-level graph for graphviz")
    args = ap.parse_args(argv)
    mods = load_modules()
    if args.graph:
        for name in sorted(mods):
            print(f"{name}: {', '.join(sorted(mods[name].imports)) or '-'}")
    if args.layers:
        for src, dsts in sorted(layer_edges(mods).items()):
            print(f"{src} -> {', '.join(sorted(dsts))}")
    if args.dot:
        body = "".join(f'  "{s}" -> "{d}";\n' for s, ds in sorted(layer_edges(mods).items()) for d in sorted(ds))
        Path(args.dot).write_text("digraph ucp_store {\n  rankdir=LR;\n" + body + "}\n")
    if not (args.graph or args.layers or args.dot):
        print(summary(mods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
