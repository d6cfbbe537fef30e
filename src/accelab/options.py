"""A command's options, carried into the config dataclasses they set.

Each option of a command is declared once, in its typer signature, under the name of the config
field it sets (or a name its config module maps: `renamed`); `fields_of` carries them by name, and
tests/test_command_options.py checks every command's options against its configs' fields.

The configs check their values: a `__post_init__` refuses anything outside a field's Literal,
naming the field, the value and the choices. `as_choice` only gives a string that is checked
there its Literal type, so a wrong value is refused by the config, with its message, where it
always was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, TypeVar, cast

C = TypeVar("C", bound=str)


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
