"""Sizes held in src/: modules over 400 lines (a file's line count, as `wc -l`), classes over 200
lines (from `class` to its last line) and functions over 50 (from `def` to their last line). The
few allowed over the line are named below with why, and count toward the limits; one that shrinks
under its line leaves the list (so the list says what is true)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 400, 200, 50
MOST_MODULES, MOST_CLASSES, MOST_FUNCTIONS = 4, 6, 10

# the serving core's step loop, scheduler and torch step engine: the next steps of its restructuring
# (the scheduler owning step policy, one deliver for every worker, a runner package) split them
MODULES = {
    "accelab/serve/continuous.py": "the continuous worker: n > 1 forks and image timing move to the scheduler",
    "accelab/serve/scheduler.py": "admission, chunked prefill, preemption and prefix reuse in one policy",
    "accelab/serve/runner/compiled_decode.py": "two compiled graphs and their guards, with the why of each",
    "accelab/serve/runner/ragged.py": "the torch step engine: its check and compiled steps go to a runner package",
}
CLASSES = {
    "accelab/serve/continuous.py:ContinuousWorker": "see its module",
    "accelab/serve/scheduler.py:Scheduler": "see its module",
    "accelab/serve/runner/ragged.py:RaggedTorchEngine": "see its module",
    "accelab/serve/state.py:ServerState": "loading, the three workers' start and the metrics' hooks",
    "accelab/serve/engines/generation.py:HFGenerationEngine": "chat templates, images, tools and both step kinds",
    "accelab/serve/config.py:ServeConfig": "one field and its check per `accelab serve` option",
}
FUNCTIONS = {
    "accelab/serve/runner/compiled_decode.py:__init__": "the compiled steps' set-up, in the order it must run",
    "accelab/serve/runner/compiled_decode.py:_layers": "one decoder layer of the compiled graph, written out",
    "accelab/serve/scheduler.py:schedule": "one step's policy, read top to bottom",
    "accelab/api.py:tune": "the Python API's tune: its options, documented where they are taken",
    "accelab/train/bench.py:run_bench": "the training bench's rows, in the order they run",
}


def _sizes(root: Path = SRC) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Lines of each module, class and function under `root` (a name defined twice: its longest)."""
    modules: dict[str, int] = {}
    classes: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        text = path.read_text()
        modules[name] = text.count("\n")
        for node in ast.walk(ast.parse(text)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef):
                classes[f"{name}:{node.name}"] = max(lines, classes.get(f"{name}:{node.name}", 0))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions[f"{name}:{node.name}"] = max(lines, functions.get(f"{name}:{node.name}", 0))
    return modules, classes, functions


def _over(sizes: dict[str, int], limit: int) -> dict[str, int]:
    return {name: size for name, size in sizes.items() if size > limit}


def test_modules_over_400_lines_are_the_few_named():
    over = _over(_sizes()[0], MODULE_LINES)
    assert set(over) == set(MODULES), f"over {MODULE_LINES} lines: {over}; named: {sorted(MODULES)}"
    assert len(MODULES) <= MOST_MODULES


def test_classes_over_200_lines_are_the_few_named():
    over = _over(_sizes()[1], CLASS_LINES)
    assert set(over) == set(CLASSES), f"over {CLASS_LINES} lines: {over}; named: {sorted(CLASSES)}"
    assert len(CLASSES) <= MOST_CLASSES


def test_functions_over_50_lines_are_the_few_named():
    over = _over(_sizes()[2], FUNCTION_LINES)
    assert set(over) == set(FUNCTIONS), f"over {FUNCTION_LINES} lines: {over}; named: {sorted(FUNCTIONS)}"
    assert len(FUNCTIONS) <= MOST_FUNCTIONS


def test_sizes_are_counted_as_wc_and_from_class_or_def_to_the_last_line(tmp_path):
    (tmp_path / "pkg").mkdir()
    lines = ['"""doc"""', "", "", "@decorated", "class A:", "    def f(self):", "        x = 1", "", "        return x"]
    (tmp_path / "pkg" / "m.py").write_text("\n".join([*lines, "", "", "def g():", "    pass", ""]))
    modules, classes, functions = _sizes(tmp_path)
    assert modules == {"pkg/m.py": 13}  # what `wc -l` says of it
    assert classes == {"pkg/m.py:A": 5}  # `class` to its last line (its decorator not counted)
    assert functions == {"pkg/m.py:f": 4, "pkg/m.py:g": 2}
