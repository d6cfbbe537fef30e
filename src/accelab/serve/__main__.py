"""`python -m accelab.serve MODEL ...`: the same command as `accelab serve MODEL ...`."""

from __future__ import annotations

import os
import sys

import typer

from accelab.serve.commands import register


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)  # one command: typer runs it without a sub-command name
    try:
        app()
    except ValueError as err:  # user errors: the message says what was wrong and how to fix it
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
