"""`python -m accelab.loadtest URL ...`: the same command as `accelab loadtest URL ...`."""

from __future__ import annotations

from accelab.entry import run_one
from accelab.loadtest.commands import register


def main() -> None:
    run_one(register)


if __name__ == "__main__":
    main()
