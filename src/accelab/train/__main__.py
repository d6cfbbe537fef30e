"""`python -m accelab.train ...`: the `accelab train` command on its own."""

from __future__ import annotations

from accelab.entry import run_one
from accelab.train.commands import train_command


def main() -> None:
    run_one(lambda app: app.command()(train_command))


if __name__ == "__main__":
    main()
