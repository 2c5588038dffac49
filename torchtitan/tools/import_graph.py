"""The import graph of the torchtitan package, and its circles.

    python -m torchtitan.tools.import_graph            # lists circles (exit 1 if any)
    python -m torchtitan.tools.import_graph --dot      # the graph in Graphviz DOT (pipe to `dot -Tsvg`)

Edges are read from the source (ast), so nothing is imported. Importing a package runs its __init__, so
`import torchtitan.a.b` is an edge to torchtitan.a as well as to torchtitan.a.b. Imports inside functions
(deferred, e.g. the model registry importing the model folders on first use) are edges too, marked as
deferred in the DOT output: a deferred import still ties two modules together, so it may not close a circle.
"""

import ast
import sys
from pathlib import Path

PACKAGE = "torchtitan"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The torchtitan modules an import statement loads (the deepest known module of each name)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for name in names:
        parts = name.split(".")
        # Every package on the way is imported too (its __init__ runs).
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and prefix != PACKAGE:
                out.append(prefix)
    return out


def import_graph(root: Path) -> dict[str, dict[str, bool]]:
    """module -> {imported module: deferred?} for every module of the package under `root`."""
    files = {_module_name(p, root): p for p in (root / PACKAGE).rglob("*.py")}
    known = set(files)
    graph: dict[str, dict[str, bool]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: dict[str, bool] = {}
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, path.name == "__init__.py", known):
                    # A module inside a package is loaded after that package's __init__ has started, so an
                    # edge to one of its own parent packages adds nothing.
                    if target != module and not module.startswith(target + "."):
                        deferred = id(node) not in top_level
                        edges[target] = edges.get(target, True) and deferred
        graph[module] = edges
    return graph


def circles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def to_dot(graph: dict[str, dict[str, bool]]) -> str:
    lines = ["digraph torchtitan {", "  rankdir=LR; node [shape=box, fontsize=10];"]
    for module in sorted(graph):
        for target, deferred in sorted(graph[module].items()):
            style = " [style=dashed]" if deferred else ""
            lines.append(f'  "{module}" -> "{target}"{style};')
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[2]
    graph = import_graph(root)
    if "--dot" in argv:
        print(to_dot(graph))
        return 0
    found = circles(graph)
    for c in found:
        print("import circle: " + " <-> ".join(c))
    if not found:
        print(f"no import circle among {len(graph)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
