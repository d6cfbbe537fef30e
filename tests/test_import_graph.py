"""The import graph of src/accelab (tools/import_graph.py): no package imports one above it, no
cycle between packages, no cycle between files."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import import_graph  # noqa: E402 - tools/ is not a package: it is put on sys.path first

SRC = ROOT / "src"


def test_no_package_imports_a_layer_above_it_and_no_package_cycle():
    found = import_graph.edges(SRC)
    assert import_graph.unlayered(found) == []
    assert import_graph.upward(found) == []
    assert import_graph.cycles(import_graph.graph_of(found)) == []


def test_no_file_cycle_not_even_through_type_checking_imports():
    assert import_graph.cycles(import_graph.graph_of(import_graph.file_edges(SRC))) == []
    assert import_graph.cycles(import_graph.graph_of(import_graph.file_edges(SRC, type_checking=True))) == []


def test_the_file_graph_sees_lazy_imports_and_leaves_out_type_checking_ones(tmp_path):
    package = tmp_path / "accelab"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "one.py").write_text("def f():\n    from accelab.a.two import g\n    return g\n")
    (package / "a" / "two.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from accelab.a import three\n"
        "from accelab.a import one\n\ndef g():\n    pass\n"
    )
    (package / "a" / "three.py").write_text("from . import two\n")
    arrows = import_graph.file_edges(tmp_path)
    assert set(arrows) == {
        ("accelab.a.one", "accelab.a.two"),
        ("accelab.a.two", "accelab.a.one"),
        ("accelab.a.three", "accelab.a.two"),
    }
    assert import_graph.cycles(import_graph.graph_of(arrows)) == [["accelab.a.one", "accelab.a.two"]]


def test_an_import_inside_a_function_defers_something_heavy():
    without_reason = [lazy for lazy in import_graph.lazy_imports(SRC) if lazy.reason is None]
    assert [f"{lazy.source}:{lazy.line} {lazy.name}" for lazy in without_reason] == []


def test_lazy_reasons_follow_the_importers_own_imports(tmp_path):
    package = tmp_path / "accelab"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text("COMMAND_MODULES = ['accelab.commands']\n")
    (package / "commands.py").write_text("def run():\n    from accelab import light, heavy\n    import json\n")
    (package / "light.py").write_text("import json\n")
    (package / "heavy.py").write_text("import torch\n\ndef f():\n    import torch.nn\n    from accelab import light\n")
    reasons = {(lazy.source, lazy.name): lazy.reason for lazy in import_graph.lazy_imports(tmp_path)}
    assert reasons[("accelab.commands", "accelab.light")] == "start-up: `accelab --help` does not import it"
    assert reasons[("accelab.commands", "accelab.heavy")] == "loads torch"
    assert reasons[("accelab.commands", "json")] is None  # the standard library is no reason
    assert reasons[("accelab.heavy", "torch.nn")] is None  # torch is loaded at its top anyway
    assert reasons[("accelab.heavy", "accelab.light")] is None


def test_each_serving_module_imports_first_in_a_fresh_interpreter():
    """A module imported before any other of the package must import: the graph above reads
    `from accelab.serve.engines.base import x` as an arrow to base.py, but Python runs the package's
    __init__ first, which imports its engines; a module that those import back, half initialised,
    failed only when imported first (the test faults' `from accelab.serve.continuous import
    ContinuousWorker` did, and a slowed server ran at full speed)."""
    import subprocess

    modules = [
        "accelab.serve.continuous",
        "accelab.serve.scheduler",
        "accelab.serve.jobs",
        "accelab.serve.engines.delivery",
        "accelab.serve.engines.vllm_worker",
        "accelab.serve.engines.batch_rows",
        "accelab.serve.runner.ragged",
        "accelab.serve.runner.sampling",
        "accelab.serve.metrics",
        "accelab.serve.state",
    ]
    for module in modules:
        run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, check=False)
        assert run.returncode == 0, f"import {module} first: {run.stderr[-2000:]}"
