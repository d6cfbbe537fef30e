"""The import graph of src/accelab between its packages: cycles, and arrows that point up the layers.

    python tools/import_graph.py [SRC_DIR]

Every `import` counts, at module level or inside a function (a lazy import is still a
dependency). A package is a first-level name under accelab (accelab.plan, accelab.serve, ...;
a top-level module such as accelab/runtimes.py is its own). The layers, lowest first, are the
data flow of DESIGN.md: a package may import those below it; an import of one above is an
upward arrow, and a cycle is a strongly connected set of two or more packages.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

LAYERS = [
    ["paths", "units", "quiet", "entry", "__version__"],  # `from accelab import __version__`: a constant
    ["results"],
    ["catalog"],
    ["plan"],
    ["backends"],
    ["runtimes"],
    ["measure"],  # runs and times what plan/ and the runtimes build; probes techniques
    ["scenarios", "quality"],
    ["bench", "launch"],
    ["tune", "train", "predict", "serve", "loadtest"],
    ["report"],
    ["api", "cli", "__init__", "__main__"],  # the front doors: the Python API and the commands
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "accelab" and len(parts) > 1 else None


def edges(src: Path) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    root = src / "accelab"
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        here = package_of(".".join(rel.parts))
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "accelab" else [])
            for name in names:
                there = package_of(name)
                if there and here and there != here and not (name == "accelab"):
                    found[(here, there)].append(str(path.relative_to(root)))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src")
    found = edges(src)
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in found:
        graph[a].add(b)
    up = sorted((a, b) for a, b in found if RANK.get(a, 99) < RANK.get(b, 99))
    print(f"{len(found)} arrows between {len(set(graph) | {b for _, b in found})} packages")
    print(f"upward arrows ({len(up)}):")
    for a, b in up:
        files = sorted(set(found[(a, b)]))
        print(f"  {a} -> {b}   ({', '.join(files[:4])}{' ...' if len(files) > 4 else ''})")
    groups = cycles(graph)
    print(f"cycles ({len(groups)}):" + ("" if groups else " none"))
    for group in groups:
        print("  " + " <-> ".join(group))
    unknown = sorted({p for pair in found for p in pair if p not in RANK})
    if unknown:
        print(f"packages without a layer: {', '.join(unknown)}")


if __name__ == "__main__":
    main()
