"""`python -m accelab.predict MODEL --inputs SRC --out OUT ...`: the `accelab predict` command on its own."""

from __future__ import annotations

import sys

import typer

from accelab.predict.commands import predict_command


def main() -> None:
    from accelab.quiet import quiet_third_party

    quiet_third_party()
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(predict_command)
    try:
        app()
    except ValueError as err:  # user errors: the message says what and how to fix it
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
