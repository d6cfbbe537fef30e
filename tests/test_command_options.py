"""Each option of `accelab train` is declared once against the field it sets: the test checks the
typer signature against TrainConfig and LaunchOptions (names, defaults) and against the `explicit`
mapping that carries them to `build_request`, so a new option that misses one of them fails here.

(Issue 25 chose checking over generating the command line from the dataclasses: the typer
signatures are what `--help` shows today, byte for byte, and generating them would need flag
names, short aliases and help text on every field of every command first.)"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import MISSING, fields

import typer

from accelab.launch import LaunchOptions
from accelab.train.commands import train_command
from accelab.train.config import TrainConfig

# options whose parameter name differs from the TrainConfig field they set
RENAMED = {"compile_": "compile", "bench_warmup": "timing_warmup"}
# options that are not a TrainConfig field: what to train, where results go, the --bench rows
COMMAND_ONLY = {
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
    "json_out",
    "db",
    "tag",
    "store",
}
# set on TrainConfig by build_request from other options, never by an option of their own
DERIVED = {
    "task",
    "dataset",
    "dataset_kind",
    "model",
    "model_source",
    "world_size",
    "output_dir",
    "checkpoints",
    "save_final",
    "resume_from",
    "save_as",
    "attention",
    "turns_dir",
    "turns_row",
    "seconds_per_turn",
    "result_path",
}


def _options() -> dict[str, typer.models.OptionInfo]:
    return {name: p.default for name, p in inspect.signature(train_command).parameters.items()}


def _explicit_keys() -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(train_command)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "explicit" for t in node.targets):
            return {k.value for k in node.value.keys}  # type: ignore[attr-defined]  # a dict literal of str keys
    raise AssertionError("train_command builds no `explicit` mapping")


def test_every_train_option_sets_one_field_or_is_the_commands_own():
    config = {f.name for f in fields(TrainConfig)}
    launch = {f.name for f in fields(LaunchOptions)}
    for name in _options():
        target = RENAMED.get(name, name)
        homes = [home for home, names in (("TrainConfig", config), ("LaunchOptions", launch)) if target in names]
        if name in COMMAND_ONLY:
            assert name not in RENAMED, name
            continue
        assert len(homes) == 1, (
            f"--{name.replace('_', '-')}: sets {homes or 'no field'}; add it to TrainConfig or COMMAND_ONLY"
        )
    unused = (config - DERIVED) - {RENAMED.get(n, n) for n in _options()}
    assert unused == set(), f"TrainConfig fields no option sets (add an option or list them in DERIVED): {unused}"


def test_the_explicit_mapping_carries_every_config_option():
    config = {f.name for f in fields(TrainConfig)}
    carried = {RENAMED.get(n, n) for n in _options() if n not in COMMAND_ONLY} & config
    assert _explicit_keys() == carried


def test_option_defaults_are_the_fields_defaults():
    """An option's default is its field's, or None ("unset": the Plan or the task's default decides)."""
    defaults = {
        f.name: f.default
        for dataclass in (TrainConfig, LaunchOptions)
        for f in fields(dataclass)
        if f.default is not MISSING
    }
    for name, info in _options().items():
        target = RENAMED.get(name, name)
        if name in COMMAND_ONLY or target not in defaults or info.default is None:
            continue
        assert info.default == defaults[target], (
            f"--{name.replace('_', '-')} defaults to {info.default!r}, the field {target} to {defaults[target]!r}"
        )
