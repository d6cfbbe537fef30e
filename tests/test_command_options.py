"""Each option of a command is declared once against the field it sets: for every command whose
options fill config dataclasses (train, predict, bench, compare, serve, loadtest), the test checks
the typer signature against the configs (names, defaults) and against the names the config
modules map (`OPTION_FIELDS`, carried by `accelab.options.fields_of`), so a new option that
misses its field, or a field no option sets, fails here.

(Issue 25 chose checking over generating the command line from the dataclasses: the typer
signatures are what `--help` shows today, byte for byte, and generating them would need flag
names, short aliases and help text on every field of every command first.)"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields

import pytest
import typer

from accelab.benchmark.commands import bench_command, compare_command
from accelab.benchmark.rounds import RoundsConfig
from accelab.launch import LaunchOptions
from accelab.loadtest import client as loadtest_client, run as loadtest_run
from accelab.loadtest.commands import loadtest_command
from accelab.predict import options as predict_options
from accelab.predict.commands import predict_command
from accelab.predict.config import PredictConfig
from accelab.scenarios.workload import Workload
from accelab.serve import config as serve_config
from accelab.serve.commands import serve_command
from accelab.train import config as train_config
from accelab.train.commands import train_command

OUTPUT = {"json_out", "db", "tag", "store"}  # where a Result goes


@dataclass(frozen=True, kw_only=True)
class Command:
    function: Callable[..., None]
    configs: tuple[type, ...]  # the dataclasses its options set
    renamed: Mapping[str, str]  # option -> the field it sets, where the names differ
    own: frozenset[str]  # options that set no field: what to run, where results go, ...
    derived: frozenset[str] = frozenset()  # fields no option sets (the command or a later step does)
    converted: frozenset[str] = frozenset()  # options whose value is converted on the way ("auto", "16,32")

    def options(self) -> dict[str, typer.models.ParameterInfo]:
        return {
            name: p.default
            for name, p in inspect.signature(self.function).parameters.items()
            if p.annotation not in (typer.Context, "typer.Context")
        }

    def fields(self) -> dict[str, set[str]]:
        return {config.__name__: {f.name for f in fields(config)} for config in self.configs}


COMMANDS = {
    "train": Command(
        function=train_command,
        configs=(train_config.TrainConfig, LaunchOptions),
        renamed=train_config.OPTION_FIELDS,
        # what to train, where results go, the --bench rows
        own=frozenset(
            {
                "model",
                "task",
                "dataset",
                "plan",
                "compile_mode",
                "output_dir",
                "resume",
                "save_as",
                "save",
                "bench",
                "bench_nproc",
                "bench_accum",
                "max_seconds_per_plan",
                "timeout",
                *OUTPUT,
            }
        ),
        derived=train_config.DERIVED,
    ),
    "predict": Command(
        function=predict_command,
        configs=(PredictConfig, LaunchOptions),
        renamed={k: v for k, v in predict_options.OPTION_NAMES.items() if k != "set_"},
        # what to run over what (resolved by build_request into spec, plan, task, source), and
        # how: --set and --threads change the plan, --overwrite the output
        own=frozenset({"model", "inputs", "task", "plan", "set_", "threads", "overwrite", *OUTPUT}),
        derived=frozenset(
            {"spec", "plan", "source", "task", "source_items", "source_digest", "world_size", "summary_path"}
        ),
    ),
    "bench": Command(
        function=bench_command,
        configs=(Workload,),
        renamed={},
        own=frozenset({"model", "task", "plan", "set_", "threads", "device", "timeout", *OUTPUT}),
        derived=frozenset({"max_seconds"}),
        converted=frozenset({"scenario"}),  # auto: the model's task decides (build_request)
    ),
    "compare": Command(
        function=compare_command,
        configs=(Workload, RoundsConfig),
        renamed={},
        own=frozenset(
            {
                "model",
                "plans",
                "task",
                "set_",
                "threads",
                "device",
                "quality",
                "samples",
                "tolerance",
                "timeout",
                "max_seconds_per_plan",
                "csv_out",
                "markdown_out",
                *OUTPUT,
            }
        ),
        derived=frozenset({"max_seconds", "extra", "min_usable", "settle_s"}),
        converted=frozenset({"scenario"}),
    ),
    "serve": Command(
        function=serve_command,
        configs=(serve_config.ServeConfig,),
        renamed=serve_config.OPTION_FIELDS,
        own=frozenset(
            {"model", "task", "plan", "set_", "device", "served_name", "access_log", "replicas", "ray_address"}
        ),
        derived=frozenset({"model_name", "plan_name"}),  # MODEL (or --served-name) and the plan's name
    ),
    "loadtest": Command(
        function=loadtest_command,
        configs=(loadtest_client.LoadConfig, loadtest_run.LoadTestRequest),
        renamed={**loadtest_client.OPTION_FIELDS, **loadtest_run.OPTION_FIELDS},
        own=frozenset({"prompts_file", "json_out", "db", "store"}),
        derived=frozenset({"inputs", "config"}),  # the inputs come from --prompts-file (or the samples)
        converted=frozenset({"max_tokens", "slo"}),  # "16,128" -> (16, 128); "ttft=500ms" -> SLO
    ),
}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_sets_one_field_or_is_the_commands_own(name):
    command = COMMANDS[name]
    homes = command.fields()
    options = command.options()
    for option in options:
        target = command.renamed.get(option, option)
        where = [config for config, names in homes.items() if target in names]
        if option in command.own:
            assert option not in command.renamed, option
            continue
        assert len(where) == 1, (
            f"accelab {name} --{option.replace('_', '-')}: sets {where or 'no field'}; "
            "add it to a config or to the command's own options"
        )
    every = set().union(*homes.values())
    unused = every - command.derived - {command.renamed.get(o, o) for o in options if o not in command.own}
    assert unused == set(), f"accelab {name}: fields no option sets (add an option or list them as derived): {unused}"
    assert set(command.renamed) <= set(options) and set(command.renamed.values()) <= every, command.renamed


@pytest.mark.parametrize("name", COMMANDS)
def test_option_defaults_are_the_fields_defaults(name):
    """An option's default is its field's, or None ("unset": the Plan or the task's default decides)."""
    command = COMMANDS[name]
    defaults = {f.name: f.default for config in command.configs for f in fields(config) if f.default is not MISSING}
    for option, info in command.options().items():
        target = command.renamed.get(option, option)
        if option in command.own | command.converted or target not in defaults or info.default in (None, ...):
            continue
        assert info.default == defaults[target], (
            f"accelab {name} --{option.replace('_', '-')} defaults to {info.default!r}, "
            f"the field {target} to {defaults[target]!r}"
        )


def test_the_train_mapping_carries_every_config_option():
    command = COMMANDS["train"]
    config = {f.name for f in fields(train_config.TrainConfig)}
    options = command.options()
    carried = {command.renamed.get(n, n) for n in options if n not in command.own} & config
    given = {name: info.default for name, info in options.items()}
    assert set(train_config.explicit_fields(given)) == carried


def test_train_compile_flags_set_one_field():
    given = {name: info.default for name, info in COMMANDS["train"].options().items()}
    assert train_config.explicit_fields({**given, "compile_": None})["compile"] is None  # unset: the plan's
    assert train_config.explicit_fields({**given, "compile_": False})["compile"] == "off"
    assert train_config.explicit_fields({**given, "compile_": True, "compile_mode": "max-autotune"})["compile"] == (
        "max-autotune"
    )


def test_predict_options_reach_build_request_by_name():
    """Every option build_request takes is passed under its parameter's name; PredictConfig fields
    go through its **options."""
    command = COMMANDS["predict"]
    given = {name: info.default for name, info in command.options().items()}
    passed = predict_options.request_options(given)
    takes = set(inspect.signature(predict_options.build_request).parameters) - {"options", "launch", "cpus"}
    config = {f.name for f in fields(PredictConfig)}
    assert takes <= set(passed)
    assert set(passed) - takes <= config
    assert not set(passed) & {f.name for f in fields(LaunchOptions)}
