"""How accelab's commands start and end: the `accelab` command and each `python -m
accelab.<capability>` run the same way, and a user error (ValueError) ends them with its message
and exit code 2, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer

from accelab.quiet import quiet_third_party_process_wide


def run_app(app: typer.Typer) -> None:
    # a process entry point (the `accelab` command, `python -m accelab.<capability>`): quiet
    # third-party libraries for the whole process, keeping any variable the user set
    quiet_third_party_process_wide()
    try:
        app()
    except ValueError as err:  # user errors: the message says what was wrong and how to fix it
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        sys.exit(2)


def run_one(add: Callable[[typer.Typer], object]) -> None:
    """`python -m accelab.<capability>`: one command, which typer runs without a sub-command name;
    `add(app)` registers it."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    add(app)
    run_app(app)
