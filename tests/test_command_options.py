"""Each option of a command is declared once, as metadata on the config field it sets
(`accelab.options.option`), and `accelab.options.command` makes the typer signature from them:
for every command made so (GENERATED) the tests check that every option maps to one field and
back, that its default is the field's, that `--help` lists it with its help, and that a bad value
still gets typer's error.

Where the config an option ends in lives in a module the command line must not import at start-up
(it loads torch or httpx: RoundsConfig, TuneRequest, LoadConfig), the option is declared on a light
dataclass of the command's, and the tests below check the names and defaults against the real
config (COMMANDS, and the tune tests), so a new option that misses its field, or a field no option
sets, fails here."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Literal

import pytest
import typer
from rich.markup import escape
from typer.main import get_command
from typer.testing import CliRunner

from accelab.benchmark import commands as bench_commands
from accelab.benchmark.commands import bench_command, compare_command
from accelab.benchmark.config import COMPARE_OUTPUT, COMPARE_WORKLOAD, BenchRun, CompareRun
from accelab.benchmark.rounds import RoundsConfig
from accelab.launch import LaunchOptions
from accelab.loadtest import client as loadtest_client, commands as loadtest_commands, run as loadtest_run
from accelab.loadtest.commands import loadtest_command
from accelab.loadtest.config import LoadOptions
from accelab.options import Option, Options, Output, as_options, command, fields_of, option, values_of
from accelab.predict import commands as predict_commands
from accelab.predict.config import PredictConfig, PredictRun
from accelab.scenarios.workload import Workload
from accelab.serve import commands as serve_commands
from accelab.serve.config import ServeConfig, ServeRun
from accelab.train import commands as train_commands, run_options as train_config
from accelab.train.config import TrainConfig
from accelab.train.run_options import TrainRun
from accelab.tuner import commands as tune_commands, options as tune_options
from accelab.tuner.options import TuneOptions

OUTPUT = {"json_out", "db", "tag", "store"}  # where a Result goes

# the commands made from their configs: (register, name, the sources of their options, their own parameters)
GENERATED = {
    "train": (train_commands.register, (TrainRun, TrainConfig, LaunchOptions, Output), set()),
    "predict": (predict_commands.register, (PredictRun, PredictConfig, LaunchOptions, Output), {"model"}),
    "serve": (serve_commands.register, (ServeRun, ServeConfig), {"ctx", "model"}),
    "tune": (tune_commands.register, (TuneOptions,), {"model"}),
    "bench": (bench_commands.register, (BenchRun, Workload, Output), {"model"}),
    "compare": (bench_commands.register, (CompareRun, COMPARE_WORKLOAD, COMPARE_OUTPUT), {"model"}),
    "loadtest": (loadtest_commands.register, (LoadOptions, Output), {"url"}),
}
# configs whose options are converted on the way (a plan's settings, "auto"), not made from the defaults
CONVERTED = (TrainConfig, PredictConfig, ServeConfig, Workload)


def _click(name: str):
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    GENERATED[name][0](app)
    return app, get_command(app).commands[name]


def _declared(name: str) -> dict[str, tuple[type, dataclasses.Field, Option]]:
    out: dict[str, tuple[type, dataclasses.Field, Option]] = {}
    for source in GENERATED[name][1]:
        for f, declared in as_options(source).declared():
            assert f.name not in out, f"accelab {name}: option {f.name} declared by two configs"
            out[f.name] = (as_options(source).config, f, declared)
    return out


@pytest.mark.parametrize("name", GENERATED)
def test_every_option_is_one_field_and_carries_back_into_its_config(name):
    _, click_command = _click(name)
    declared = _declared(name)
    parameters = {p.name for p in click_command.params} - GENERATED[name][2]
    assert parameters == set(declared)
    # the defaults, carried back by field name, make every config (the required ones given)
    given = {p.name: p.default for p in click_command.params}
    for source in GENERATED[name][1]:
        config = as_options(source).config
        values = {k: v for k, v in fields_of(config, given).items() if v is not None}
        required = {f.name for f in fields(config) if f.default is MISSING and f.default_factory is MISSING}
        assert set(values_of(config, given)) <= {f.name for f in fields(config)}
        if not required - set(values) and config not in CONVERTED:
            config(**values)


@pytest.mark.parametrize("name", GENERATED)
def test_option_defaults_are_the_fields_defaults(name):
    """An option's default is its field's, or None where declared unset (the Plan or the task's
    default decides), or the one declared where the command converts it, or a required option for
    a field without a default."""
    _, click_command = _click(name)
    defaults = {p.name: p.default for p in click_command.params}
    for field_name, (config, f, declared) in _declared(name).items():
        if declared.default is None:
            assert defaults[field_name] is None, field_name
        elif declared.default != Option().default:  # the command converts it ("auto": the task decides)
            assert defaults[field_name] == declared.default, field_name
        elif f.default_factory is not MISSING:
            assert defaults[field_name] == f.default_factory(), field_name
        elif f.default is MISSING:
            assert next(p for p in click_command.params if p.name == field_name).required, field_name
        else:
            assert defaults[field_name] == f.default, f"{config.__name__}.{field_name}"


@pytest.mark.parametrize("name", GENERATED)
def test_help_lists_every_option_with_its_help(name):
    app, click_command = _click(name)
    shown = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    by_name = {p.name: p for p in click_command.params}
    for field_name, (_, _, declared) in _declared(name).items():
        parameter = by_name[field_name]
        assert parameter.opts[0] in shown.output, parameter.opts
        assert parameter.help == (declared.help and escape(declared.help)), field_name  # as written, not markup
        if declared.flags:
            assert declared.flags[0].split("/")[0] in parameter.opts, (field_name, parameter.opts)
        else:
            assert parameter.opts == [f"--{field_name.replace('_', '-')}"]


@pytest.mark.parametrize(
    ("name", "args", "flag"),
    [
        ("serve", ["m", "--port", "eighty"], "--port"),
        ("train", ["--epochs", "many"], "--epochs"),
        ("predict", ["m", "-i", "x.txt", "-o", "y.jsonl", "--top-k", "1.5"], "--top-k"),
        ("tune", ["m", "--seq-len", "many"], "--seq-len"),
        ("bench", ["m", "--warmup", "x"], "--warmup"),
        ("compare", ["m", "--rounds", "x"], "--rounds"),
        ("loadtest", ["http://127.0.0.1:1", "--rate", "fast"], "--rate"),
    ],
)
def test_a_bad_value_gets_typers_error(name, args, flag):
    app, _ = _click(name)
    result = CliRunner().invoke(app, [name, *args], terminal_width=200)
    assert result.exit_code == 2
    assert "Invalid value" in result.output and flag in result.output


def test_a_literal_field_takes_any_string_for_its_config_to_refuse():
    """typer would refuse a choice with a message of its own; the config's names the field and the fix."""

    @dataclass(frozen=True, kw_only=True)
    class Shape:
        kind: Literal["a", "b"] = field_with("a", option("The kind."))
        size: int | None = field_with(None, option("The size.", "--size", "-s"))
        count: int = field_with(3, option("How many.", unset=True))
        mode: str = field_with("x", option("The mode.", default="auto"))

    @command(Shape)
    def run(**options) -> None:
        pass

    parameters = inspect.signature(run).parameters
    assert parameters["kind"].annotation is str and parameters["kind"].default.default == "a"
    assert parameters["size"].annotation == int | None and parameters["size"].default.param_decls == ("--size", "-s")
    assert parameters["count"].annotation == int | None and parameters["count"].default.default is None
    assert parameters["mode"].default.default == "auto"
    assert Options(config=Shape, declare={"size": Option(help="Other.")}).defaults()["size"] is None


def field_with(default, metadata):
    return dataclasses.field(default=default, metadata=metadata)


def test_train_compile_flags_set_one_field():
    given = {name: p.default for name, p in inspect.signature(train_commands.train_command).parameters.items()}
    given = {name: info.default for name, info in given.items()}
    assert train_config.explicit_fields({**given, "compile": None})["compile"] is None  # unset: the plan's
    assert train_config.explicit_fields({**given, "compile": False})["compile"] == "off"
    assert train_config.explicit_fields({**given, "compile": True, "compile_mode": "max-autotune"})["compile"] == (
        "max-autotune"
    )
    assert set(train_config.explicit_fields(given)) == {f.name for f, _ in Options(config=TrainConfig).declared()}


def test_serve_takes_the_plans_settings_under_the_option_names_typed():
    """The names a plan's server settings use are the options' (the fields'), so a typed option wins."""
    options = {f.name: declared for f, declared in Options(config=ServeConfig).declared()}
    assert {"max_batch_size", "max_step_tokens", "kv_cache_tokens", "request_timeout_s"} <= set(options)
    assert options["request_timeout_s"].flags == ("--request-timeout",)


def test_tune_options_set_the_request_fields_of_their_names():
    """TuneOptions is a light mirror of the requests (they load torch): each option sets the field
    of its name in TuneRequest or ServeTuneRequest, with that field's default, or is converted by
    the builders; every request field but the model is set by an option."""
    from accelab.tuner.run import TuneRequest
    from accelab.tuner.serving import ServeTuneRequest

    requests = {config: {f.name: f for f in fields(config)} for config in (TuneRequest, ServeTuneRequest)}
    for f in fields(TuneOptions):
        target = tune_options.RENAMED.get(f.name, f.name)
        homes = [config for config, named in requests.items() if target in named]
        assert homes or f.name in {"task", "prompt_file", "concurrency", "slo"}, f.name
        for config in homes:
            # the command writes best.yaml; a request made in Python writes no Plan unless asked
            if f.name not in {*tune_options.CONVERTED, "out"}:
                assert requests[config][target].default == f.default, (config.__name__, target)
    set_by_options = {tune_options.RENAMED.get(f.name, f.name) for f in fields(TuneOptions)}
    assert set(requests[TuneRequest]) - set_by_options == {"spec"}
    assert set(requests[ServeTuneRequest]) - set_by_options == {
        "spec",
        "model",
        "prompts",
        "ready_timeout_s",
    }


@pytest.fixture
def fake_resolve(monkeypatch):
    from accelab.catalog import resolve
    from accelab.catalog.spec import ModelSpec

    def fake(model, task):
        return ModelSpec(name=model, task=task or "text-generation", source="/nowhere")

    monkeypatch.setattr(resolve, "resolve", fake)


def test_tune_builders_carry_every_option(fake_resolve, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    given = TuneOptions(
        goal="latency",
        percentile="p50",
        task="text-generation",
        scenario="generate",
        batch_size=2,
        max_batch=16,
        seq_len=64,
        new_tokens=8,
        image_size=32,
        max_memory="2GiB",
        p99_ms=50.0,
        quality="strict",
        budget="10m",
        include="baseline, bf16",
        exclude="int8",
        min_seconds=1.0,
        device="cpu",
        out=tmp_path / "best.yaml",
        plot=tmp_path / "p.png",
        json_out=tmp_path / "t.json",
        db=tmp_path / "r.db",
        fresh=True,
        concurrency="1,8",
        slo="ttft_p99=500ms",
        prompt_file=prompts,
        rounds=3,
        window=5.0,
    )
    searched = tune_options.tune_request("m", given)
    copied = {f.name for f in fields(TuneOptions)} - tune_options.CONVERTED - {"concurrency", "rounds", "window"}
    assert {name: getattr(searched, name) for name in copied} == {name: getattr(given, name) for name in copied}
    assert (searched.spec.name, searched.include, searched.exclude) == ("m", ["baseline", "bf16"], ["int8"])
    served = tune_options.serve_tune_request("m", given)
    assert (served.concurrency, served.rounds, served.window_s, served.prompts) == ((1, 8), 3, 5.0, ("one", "two"))
    assert (served.include, served.exclude, served.max_memory, served.out, served.fresh) == (
        ("baseline", "bf16"),
        ("int8",),
        "2GiB",
        tmp_path / "best.yaml",
        True,
    )
    assert served.slo.to_dict()


def test_tune_refuses_a_bad_goal_before_resolving_the_model(monkeypatch):
    from accelab.catalog import resolve

    monkeypatch.setattr(resolve, "resolve", lambda *a: pytest.fail("resolved"))
    with pytest.raises(ValueError, match="--goal 'fast' must be throughput or latency"):
        tune_options.tune_request("m", TuneOptions(goal="fast"))
    with pytest.raises(ValueError, match="--quality 'meh'"):
        tune_options.serve_tune_request("m", TuneOptions(quality="meh", scenario="serve"))


def test_compare_declares_the_rounds_options_with_roundsconfigs_defaults():
    """--rounds and --sequential set RoundsConfig's fields (declared on CompareRun: rounds.py loads torch)."""
    rounds = {f.name: f.default for f in fields(RoundsConfig)}
    declared = {f.name: f.default for f in fields(CompareRun) if f.name in rounds}
    assert declared == {"rounds": rounds["rounds"], "sequential": rounds["sequential"]}
    given = {**Options(config=CompareRun).defaults(), "rounds": 2, "sequential": True}
    assert RoundsConfig(**fields_of(RoundsConfig, given)) == RoundsConfig(rounds=2, sequential=True)


def test_compare_shows_its_own_batch_and_json_help_over_the_shared_declarations():
    workload = dict(((f.name, d) for f, d in COMPARE_WORKLOAD.declared()))
    assert workload["batch_size"].default == Option().default  # the field's: 1, the rows' shared batch
    assert Options(config=Workload).defaults()["batch_size"] is None  # bench: the plan's, else 1
    assert COMPARE_OUTPUT.defaults() == Options(config=Output).defaults()
    with pytest.raises(ValueError, match="--plans is empty"):
        CompareRun(plans=" , ")


def test_loadtest_options_make_the_request_by_name():
    """LoadTestRequest.from_options takes the options by their names; every LoadOptions field is one."""
    given = {**Options(config=LoadOptions).defaults(), **Options(config=Output).defaults(), "url": "http://h:1/v1"}
    request = loadtest_run.LoadTestRequest.from_options(
        {**given, "concurrency": 4, "duration": 5.0, "timeout": 9.0, "max_tokens": "16,128", "find_max_": False}
    )
    assert (request.config.concurrency, request.config.duration_s, request.config.timeout_s) == (4, 5.0, 9.0)
    assert (request.config.max_tokens, request.config.base_url, request.find_max) == ((16, 128), "http://h:1", False)
    assert request.config.inputs  # accelab's sample prompts


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


# the configs each command's options end in, checked against the generated signatures
COMMANDS = {
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
def test_every_option_sets_one_field_of_the_configs_it_ends_in_or_is_the_commands_own(name):
    command = COMMANDS[name]
    homes = command.fields()
    options = command.options()
    for flag in options:
        target = command.renamed.get(flag, flag)
        where = [config for config, names in homes.items() if target in names]
        if flag in command.own:
            assert flag not in command.renamed, flag
            continue
        assert len(where) == 1, (
            f"accelab {name} --{flag.replace('_', '-')}: sets {where or 'no field'}; "
            "add it to a config or to the command's own options"
        )
    every = set().union(*homes.values())
    unused = every - command.derived - {command.renamed.get(o, o) for o in options if o not in command.own}
    assert unused == set(), f"accelab {name}: fields no flag sets (add an flag or list them as derived): {unused}"
    assert set(command.renamed) <= set(options) and set(command.renamed.values()) <= every, command.renamed


@pytest.mark.parametrize("name", COMMANDS)
def test_option_defaults_are_the_defaults_of_the_configs_they_end_in(name):
    """An flag's default is its field's, or None ("unset": the Plan or the task's default decides)."""
    command = COMMANDS[name]
    defaults = {f.name: f.default for config in command.configs for f in fields(config) if f.default is not MISSING}
    for flag, info in command.options().items():
        target = command.renamed.get(flag, flag)
        if flag in command.own | command.converted or target not in defaults or info.default in (None, ...):
            continue
        assert info.default == defaults[target], (
            f"accelab {name} --{flag.replace('_', '-')} defaults to {info.default!r}, "
            f"the field {target} to {defaults[target]!r}"
        )


def test_help_shows_a_plan_with_fields_as_written():
    """Help text is plain text: rich would take `baseline[batch_size=16]` for markup and drop the brackets."""
    app, _ = _click("compare")
    shown = CliRunner().invoke(app, ["compare", "--help"], env={"COLUMNS": "300"})
    assert shown.exit_code == 0
    assert "baseline[batch_size=16]" in shown.output
