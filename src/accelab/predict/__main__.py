"""`python -m accelab.predict MODEL --inputs SRC --out OUT ...`: the `accelab predict` command on its own."""

from __future__ import annotations

from accelab.entry import run_one
from accelab.predict.commands import predict_command


def main() -> None:
    run_one(lambda app: app.command()(predict_command))


if __name__ == "__main__":
    main()
