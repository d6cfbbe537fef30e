"""A command's options, declared once on the config dataclasses they fill.

A field a command line sets carries its option in its metadata (torchtitan's configs make their
command line the same way):

    port: int = field(default=8000, metadata=option("Port to listen on."))
    request_timeout_s: float = field(default=60.0, metadata=option("...", "--request-timeout"))

`option` takes the help and the flags typer would not guess from the field's name (`--json`, a
short alias `-b`, `--x/--no-x`); its default is the field's, or None with `unset=True` (not
given: the Plan or the task's default decides), or `default=` where the command converts what is
typed ("auto"). `command(*sources)` gives a thin typer function (`def f(ctx, model, **options)`)
the signature typer reads (`inspect.signature`): its own parameters, then one option per declared
field of each source, named like the field, typed like it. `fields_of` carries the parsed values
back into a config by those names.

The configs check their values: a `__post_init__` refuses anything outside a field's Literal,
naming the field, the value and the choices, so a Literal field's option takes any string (typer
would refuse it with a message of its own), and `as_choice` gives a string that is checked there
its Literal type.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, cast

import typer

C = TypeVar("C", bound=str)
F = TypeVar("F", bound=Callable[..., Any])

OPTION: Final = "accelab.option"  # the key of a field's metadata that holds its Option
_FIELD: Final = "<the field's default>"


@dataclass(frozen=True, kw_only=True, slots=True)
class Option:
    """How a config field shows on a command line."""

    help: str | None = None
    flags: tuple[str, ...] = ()  # none: typer's --field-name
    default: Any = _FIELD  # the option's default, where it is not the field's (None: "not given")
    type: Any = None  # the option's type, where the field's is not what is typed
    envvar: str | None = None  # read from this environment variable too (and say so in --help)


def option(
    help: str | None = None, *flags: str, unset: bool = False, default: Any = _FIELD, type: Any = None, envvar=None
) -> dict[str, Option]:
    """A field's metadata: its option (see the module docstring)."""
    declared = Option(help=help, flags=flags, default=None if unset else default, type=type, envvar=envvar)
    return {OPTION: declared}


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """The options of `config`'s fields: those whose metadata declares one, and those `declare`
    declares here (over the field's own: a command that shows a field otherwise, or a config
    declared in a module the command line must not import)."""

    config: type
    declare: Mapping[str, Option] = field(default_factory=dict)

    def declared(self) -> Iterator[tuple[dataclasses.Field, Option]]:
        for f in dataclasses.fields(self.config):
            declared = self.declare.get(f.name) or f.metadata.get(OPTION)
            if declared is not None:
                yield f, declared

    def defaults(self) -> dict[str, Any]:
        """Each option's default, by field name."""
        return {f.name: _default(f, declared) for f, declared in self.declared()}

    def parameters(self) -> list[inspect.Parameter]:
        from rich.markup import escape

        hints = typing.get_type_hints(self.config)
        return [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=declared.type or _typed(hints[f.name], optional=_default(f, declared) is None),
                default=typer.Option(
                    _default(f, declared),
                    *declared.flags,
                    help=escape(declared.help) if declared.help else None,  # name[field=value] is text, not markup
                    envvar=declared.envvar,
                    show_envvar=declared.envvar is not None,
                ),
            )
            for f, declared in self.declared()
        ]


@dataclass(frozen=True, kw_only=True, slots=True)
class Output:
    """Where a command's Result goes (`accelab.results.store.keep`)."""

    json_out: Path | None = field(default=None, metadata=option("Write the Result(s) as JSON to this file.", "--json"))
    db: Path | None = field(default=None, metadata=option("Results store (SQLite); default in the cache dir."))
    tag: str | None = field(default=None, metadata=option("Label this run in the results store."))
    store: bool = field(default=True, metadata=option("Append the run(s) to the results store.", "--store/--no-store"))


def command(*sources: type | Options) -> Callable[[F], F]:
    """Gives a command function the options of `sources` (config classes, or `Options`) after
    its own parameters: typer passes them to its `**options` by field name."""

    def declare(function: F) -> F:
        signature = inspect.signature(function, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = [p for source in sources for p in as_options(source).parameters()]
        names = [p.name for p in [*own, *added]]
        assert len(names) == len(set(names)), f"{function.__name__}: an option twice in {names}"
        function.__signature__ = signature.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
        return function

    return declare


def as_options(source: type | Options) -> Options:
    return source if isinstance(source, Options) else Options(config=source)


def values_of(source: type | Options, options: Mapping[str, Any]) -> dict[str, Any]:
    """The values a command was given for `source`'s options (its `**options`), by field name."""
    return {f.name: options[f.name] for f, _ in as_options(source).declared()}


def fields_of(
    config: type, options: Mapping[str, Any], *, renamed: Mapping[str, str] | None = None, skip: Collection[str] = ()
) -> dict[str, Any]:
    """The values of `config`'s fields among a command's `options` (its parameters by name, as
    `typer.Context.params` has them): a field takes the option of its name, or the option that
    `renamed` (option -> field) maps to it. `skip`: fields the command sets otherwise, even where
    an option has their name."""
    renamed = renamed or {}
    names = {f.name for f in dataclasses.fields(config)} - set(skip)
    return {
        renamed.get(option, option): value for option, value in options.items() if renamed.get(option, option) in names
    }


def as_choice(value: str, allowed: tuple[C, ...]) -> C:
    """`value` typed as one of `allowed` (a Literal's values, `get_args(Kind)`): the member it
    equals, or `value` itself when it equals none, for the config to refuse."""
    for choice in allowed:
        if value == choice:
            return choice
    return cast(C, value)  # none of them: the config's __post_init__ refuses it


def _default(f: dataclasses.Field, declared: Option) -> Any:
    if declared.default is not _FIELD:
        return declared.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return ... if f.default is dataclasses.MISSING else f.default  # a field without a default: a required option


def _typed(hint: Any, *, optional: bool) -> Any:
    """The type typer converts an option to: a Literal's is str (the config checks the choice)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        hint = str
    elif typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _typed(inner, optional=True)
    return hint | None if optional else hint
