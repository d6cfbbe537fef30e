"""The import graph of src/accelab: between its packages (cycles, arrows that point up the layers)
and between its files (cycles).

    python tools/import_graph.py [SRC_DIR]

Packages: every `import` counts, at module level, inside a function (a lazy import is still a
dependency) or under `if TYPE_CHECKING:`. A package is a first-level name under accelab
(accelab.plan, accelab.serve, ...; a top-level module such as accelab/runtimes.py is its own).
The layers, lowest first, follow the data flow (docs/measurement.md, Concepts: a ModelSpec and a Plan make a
Runnable, measured under a Workload into a Result): a package may import those below it;
an import of one above is an upward arrow, and a cycle is a strongly connected set of two or
more packages.

Files: module to module, every import at module level or inside a function, except those
under `if TYPE_CHECKING:` (they never run). `from accelab.x import y` points at the file
accelab/x/y.py when there is one, else at accelab/x (its __init__.py). A file cycle is a
strongly connected set of two or more files: held apart only by importing one of them inside
a function, it breaks at run time when someone moves that import to the top.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

LAYERS = [
    # `from accelab import __version__` names a constant; options: a command's options into its configs
    ["paths", "units", "options", "quiet", "entry", "version", "__version__", "cpu"],
    ["results"],
    ["catalog"],
    ["plan"],
    ["ops"],  # the own C++ operators: the serving engines run them, `accelab env` probes them
    ["backends"],
    ["runtimes"],
    ["measure"],  # runs and times what plan/ and the runtimes build; probes techniques
    ["scenarios", "quality"],
    ["benchmark", "launch"],
    ["tuner", "train", "predict", "serve", "loadtest", "monitor"],
    ["report"],
    ["api", "cli", "__init__", "__main__"],  # the front doors: the Python API and the commands
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# The third-party modules worth importing inside a function, and why: each costs 50 ms or more
# to import here (torch ~1 s and 1,100 modules; `accelab --help` imports none of them), or is
# optional (an extra or a venv of its own). An accelab module is heavy when its module-level
# imports pull one of these in, directly or through other accelab modules.
LAZY_OK = {
    "torch": "heavy: ~1 s, 1,100 modules",
    "torch.utils.cpp_extension": "heavy: building a kernel imports setuptools and sympy (~1,000 modules, ~85 MB)",
    "torchao": "heavy: imports torch",
    "transformers": "heavy: imports torch, ~1-2 s",
    "accelerate": "heavy: imports torch",
    "safetensors.torch": "heavy: imports torch",
    "numpy": "heavy: ~120 ms",
    "scipy": "heavy: ~120 ms",
    "sklearn": "heavy: ~0.9 s",
    "skimage": "heavy: imports scipy",
    "matplotlib": "heavy: ~0.4 s",
    "datasets": "heavy: ~0.6 s",
    "pyarrow": "heavy: ~130 ms",
    "fastapi": "heavy: ~0.2 s (the serving stack)",
    "starlette": "heavy: the serving stack",
    "uvicorn": "heavy: ~70 ms (the serving stack)",
    "httpx": "heavy: ~110 ms",
    "aiohttp": "heavy: ~140 ms",
    "prometheus_client": "heavy: ~50 ms (the serving stack)",
    "tensorboard": "heavy: the training logger",
    "onnx": "heavy: the ONNX runtime",
    "onnxruntime": "heavy: the ONNX runtime",
    "openvino": "heavy: the OpenVINO runtime",
    "huggingface_hub": "heavy: its submodules load on first use (downloads)",
    "llguidance": "heavy: a native grammar engine, only for structured outputs",
    "pynvml": "optional: NVML is only there on NVIDIA machines",
    "llama_cpp": "optional: the [llamacpp] extra (built from source)",
    "ray": "optional: the [ray] extra",
    "vllm": "optional: lives in its own venv",
    "openvino_genai": "optional: lives in its own venv",
    "openai": "optional: the [test] extra",
    "lm_eval": "optional: the [test] extra",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Import:
    """One import statement's target, as written (`name`) and as the module file it runs (`module`)."""

    source: str  # the importing module, dotted (accelab.plan.plan)
    name: str  # the dotted name imported (accelab.plan.presets, or accelab.plan.presets.PRESETS)
    module: str  # the module whose file runs (accelab.plan.presets)
    line: int
    type_checking: bool  # under `if TYPE_CHECKING:`


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "accelab" and len(parts) > 1 else None


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST):
    """(node, under TYPE_CHECKING) for every import statement; an `else:` of the guard runs."""

    def walk(node: ast.AST, guarded: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, guarded
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), True)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), guarded)
            else:
                yield from walk(child, guarded)

    yield from walk(tree, False)


def imports(src: Path) -> list[Import]:
    root = src / "accelab"
    files = sorted(root.rglob("*.py"))
    known = {module_name(p, src) for p in files}

    def resolve(name: str) -> str | None:  # the longest prefix that is a module of ours
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                return ".".join(parts[:n])
        return None

    found = []
    for path in files:
        source = module_name(path, src)
        package = source if path.name == "__init__.py" else source.rsplit(".", 1)[0]
        for node, guarded in _statements(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                module = resolve(name)
                if module and module != source:
                    found.append(
                        Import(source=source, name=name, module=module, line=node.lineno, type_checking=guarded)
                    )
    return found


@dataclass(frozen=True, kw_only=True, slots=True)
class Statement:
    """One import statement of a file, where it stands."""

    source: str
    names: tuple[str, ...]  # dotted names it imports (accelab's and third parties')
    line: int
    in_function: bool
    type_checking: bool


def statements(src: Path) -> list[Statement]:
    """Every import statement of src/accelab, third-party ones too."""
    out = []
    for path in sorted((src / "accelab").rglob("*.py")):
        source = module_name(path, src)
        package = source if path.name == "__init__.py" else source.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        functions = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
            if n is not f
        }
        for node, guarded in _statements(tree):
            if isinstance(node, ast.Import):
                names = tuple(a.name for a in node.names)
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = tuple(f"{base}.{a.name}" for a in node.names)
            out.append(
                Statement(
                    source=source,
                    names=names,
                    line=node.lineno,
                    in_function=id(node) in functions,
                    type_checking=guarded,
                )
            )
    return out


def _lazy_ok(name: str) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAZY_OK:
            return ".".join(parts[:n])
    return None


def heavy_modules(src: Path) -> dict[str, frozenset[str]]:
    """For each accelab module, the LAZY_OK modules that importing it loads (module level only,
    through other accelab modules and their packages' __init__.py)."""
    found = statements(src)
    known = {s.source for s in found} | {module_name(p, src) for p in (src / "accelab").rglob("*.py")}

    def ours(name: str) -> list[str]:  # the module and the packages above it that importing it runs
        parts = name.split(".")
        return [".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in known]

    direct: dict[str, set[str]] = defaultdict(set)
    links: dict[str, set[str]] = defaultdict(set)
    for s in found:
        if s.in_function or s.type_checking:
            continue
        for name in s.names:
            if name.split(".")[0] == "accelab":
                links[s.source].update(m for m in ours(name) if m != s.source)
            elif heavy := _lazy_ok(name):
                direct[s.source].add(heavy)
    memo: dict[str, frozenset[str]] = {}

    def load(module: str, seen: frozenset[str]) -> frozenset[str]:
        if module in memo:
            return memo[module]
        result = set(direct[module])
        for other in links[module] - seen:
            result |= load(other, seen | {module})
        memo[module] = frozenset(result)
        return memo[module]

    return {m: load(m, frozenset()) for m in sorted(known)}


def startup_modules(src: Path) -> frozenset[str]:
    """The accelab modules `accelab --help` imports: accelab.cli, the command modules it names in
    COMMAND_MODULES (it imports them by name), and what their module-level imports pull in."""
    cli = ast.parse((src / "accelab" / "cli.py").read_text())
    roots = ["accelab.cli"]
    for node in ast.walk(cli):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.List)
            and any(isinstance(t, ast.Name) and t.id == "COMMAND_MODULES" for t in node.targets)
        ):
            roots += [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    found = statements(src)
    known = {module_name(p, src) for p in (src / "accelab").rglob("*.py")}
    links: dict[str, set[str]] = defaultdict(set)
    for s in found:
        if s.in_function or s.type_checking:
            continue
        for name in s.names:
            parts = name.split(".")
            links[s.source].update(
                ".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in known
            )
    seen: set[str] = set()
    todo = [m for root in roots for m in (root.rsplit(".", 1)[0], root)]
    while todo:
        module = todo.pop()
        if module in seen or module not in known:
            continue
        seen.add(module)
        todo.extend(links[module])
    return frozenset(seen)


@dataclass(frozen=True, kw_only=True, slots=True)
class LazyImport:
    source: str
    name: str
    line: int
    reason: str | None  # None: nothing heavy that the importer does not load anyway: belongs at the top


def lazy_imports(src: Path) -> list[LazyImport]:
    """Every import inside a function, and the reason it is there (or None)."""
    heavy = heavy_modules(src)
    startup = startup_modules(src)
    at_startup = {
        name.split(".")[0]
        for s in statements(src)
        if s.source in startup and not s.in_function and not s.type_checking
        for name in s.names
        if not name.startswith("accelab")
    }
    out = []
    for s in statements(src):
        if not s.in_function:
            continue
        for name in s.names:
            top = name.split(".")[0]
            reason = None
            if top == "accelab":
                parts = name.split(".")
                target = next(
                    (".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in heavy), "accelab"
                )
                extra = heavy[target] - heavy.get(s.source, frozenset())
                if extra:
                    reason = f"loads {', '.join(sorted(extra))}"
                elif s.source in startup and target not in startup:
                    reason = "start-up: `accelab --help` does not import it"
            elif ok := _lazy_ok(name):
                reason = None if ok in heavy.get(s.source, frozenset()) else LAZY_OK[ok]
            elif s.source in startup and top not in at_startup and top not in sys.stdlib_module_names:
                reason = "start-up: `accelab --help` does not import it"
            out.append(LazyImport(source=s.source, name=name, line=s.line, reason=reason))
    return out


def edges(src: Path) -> dict[tuple[str, str], list[str]]:
    """Package -> package arrows, each with the files that make it."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for imp in imports(src):
        here, there = package_of(imp.source), package_of(imp.name)
        # `from accelab import __version__` names the constant, not the package's __init__
        if here and there and there != here:
            found[(here, there)].append(imp.source.removeprefix("accelab.").replace(".", "/") + ".py")
    return found


def file_edges(src: Path, *, type_checking: bool = False) -> dict[tuple[str, str], list[int]]:
    """Module -> module arrows that run, each with its lines; `type_checking`: the imports under
    `if TYPE_CHECKING:` too (a cycle of those runs nothing, but still ties two files together)."""
    found: dict[tuple[str, str], list[int]] = defaultdict(list)
    for imp in imports(src):
        if type_checking or not imp.type_checking:
            found[(imp.source, imp.module)].append(imp.line)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(found: dict[tuple[str, str], list[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, b in found if RANK.get(a, 99) < RANK.get(b, 99))


def unlayered(found: dict[tuple[str, str], list[str]]) -> list[str]:
    return sorted({p for pair in found for p in pair if p not in RANK})


def graph_of(pairs) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in pairs:
        graph[a].add(b)
    return graph


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src")
    found = edges(src)
    graph = graph_of(found)
    print(f"{len(found)} arrows between {len(set(graph) | {b for _, b in found})} packages")
    up = upward(found)
    print(f"upward arrows ({len(up)}):")
    for a, b in up:
        files = sorted(set(found[(a, b)]))
        print(f"  {a} -> {b}   ({', '.join(files[:4])}{' ...' if len(files) > 4 else ''})")
    groups = cycles(graph)
    print(f"package cycles ({len(groups)}):" + ("" if groups else " none"))
    for group in groups:
        print("  " + " <-> ".join(group))
    if unknown := unlayered(found):
        print(f"packages without a layer: {', '.join(unknown)}")
    arrows = file_edges(src)
    file_graph = graph_of(arrows)
    groups = cycles(file_graph)
    print(f"{len(arrows)} arrows between files; file cycles ({len(groups)}):" + ("" if groups else " none"))
    for group in groups:
        print("  " + " <-> ".join(m.removeprefix("accelab.") for m in group))
        members = set(group)
        for a in group:
            for b in sorted(file_graph[a] & members):
                print(
                    f"      {a.removeprefix('accelab.')} -> {b.removeprefix('accelab.')}"
                    f"  (line {', '.join(map(str, arrows[(a, b)]))})"
                )
    typed = cycles(graph_of(file_edges(src, type_checking=True)))
    print(f"file cycles counting TYPE_CHECKING imports ({len(typed)}):" + ("" if typed else " none"))
    for group in typed:
        print("  " + " <-> ".join(m.removeprefix("accelab.") for m in group))
    sys.exit(1 if up or unknown or groups or typed or cycles(graph) else 0)


if __name__ == "__main__":
    main()
