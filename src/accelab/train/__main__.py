"""`python -m accelab.train ...`: the `accelab train` command on its own."""

from __future__ import annotations

import os
import sys

import typer

from accelab.train.commands import train_command


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(train_command)
    try:
        app()
    except ValueError as err:  # user errors: the message says what and how to fix it
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
