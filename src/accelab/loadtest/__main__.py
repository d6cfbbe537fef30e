"""`python -m accelab.loadtest URL ...`: the same command as `accelab loadtest URL ...`."""

from __future__ import annotations

import sys

import typer

from accelab.loadtest.commands import register


def main() -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)  # one command: typer runs it without a sub-command name
    try:
        app()
    except ValueError as err:  # user errors: the message says what was wrong and how to fix it
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
