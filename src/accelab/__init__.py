"""accelab: make Hugging Face / PyTorch models measurably faster, and prove it.

The Python API (typed, documented in `accelab.api`): `accelab.bench`, `compare`, `verify`,
`tune` measure in child processes and store their Results as the CLI does; `apply(model, plan)`
puts a plan into your own code; `CustomModel` describes a custom nn.Module with its example
inputs and task. `import accelab` stays cheap: nothing imports torch until a function runs.
"""

import inspect
import types

# api imports nothing heavy at module level; bench and tune are the commands' subpackages
from accelab import api, bench, tune
from accelab.api import apply, compare, verify
from accelab.version import __version__

__all__ = ["CustomModel", "Plan", "__version__", "apply", "bench", "compare", "tune", "verify"]


class _CommandPackage(types.ModuleType):
    """`accelab.bench` and `accelab.tune` are both a subpackage (the command's code) and the API
    function: calling the package calls `accelab.api.<name>`, and `accelab.bench.engine` still
    imports as before. (A plain function attribute would be replaced by the subpackage the first
    time Python imports it.)"""

    def __call__(self, *args, **kwargs):
        return getattr(api, self.__name__.rsplit(".", 1)[1])(*args, **kwargs)

    @property
    def __signature__(self):  # help() and IDEs show the API function's parameters
        return inspect.signature(getattr(api, self.__name__.rsplit(".", 1)[1]))


for _package in (bench, tune):
    _package.__class__ = _CommandPackage


def __getattr__(name: str):
    if name == "CustomModel":
        from accelab.catalog.custom import CustomModel

        return CustomModel
    if name == "Plan":
        from accelab.plan.plan import Plan

        return Plan
    raise AttributeError(f"module 'accelab' has no attribute {name!r}")
