"""accelab: make Hugging Face / PyTorch models measurably faster, and prove it.

The Python API (typed, documented in `accelab.api`): `accelab.bench`, `compare`, `verify`,
`tune` measure in child processes and store their Results as the CLI does; `apply(model, plan)`
puts a plan into your own code; `CustomModel` describes a custom nn.Module with its example
inputs and task. `import accelab` stays cheap: nothing imports torch until a function runs.

The commands' code lives in subpackages named apart from these functions (`accelab.benchmark`
for bench, compare and verify; `accelab.tuner` for tune), so that importing one never replaces
the function of the same name.
"""

# ACCELAB_CPU_ISA caps oneDNN and torch's kernels too: set before anything imports torch
from accelab import cpu as _cpu

_cpu.apply_override()

# api imports nothing heavy at module level
from accelab.api import apply, bench, compare, tune, verify  # noqa: E402 - after the CPU override
from accelab.version import __version__  # noqa: E402 - after the CPU override

__all__ = ["CustomModel", "Plan", "__version__", "apply", "bench", "compare", "tune", "verify"]


def __getattr__(name: str):
    if name == "CustomModel":
        from accelab.catalog.custom import CustomModel

        return CustomModel
    if name == "Plan":
        from accelab.plan.plan import Plan

        return Plan
    raise AttributeError(f"module 'accelab' has no attribute {name!r}")
