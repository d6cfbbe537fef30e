"""`python -m accelab.serve MODEL ...`: the same command as `accelab serve MODEL ...`."""

from __future__ import annotations

from accelab.entry import run_one
from accelab.serve.commands import register


def main() -> None:
    run_one(register)


if __name__ == "__main__":
    main()
