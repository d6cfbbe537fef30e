"""The `accelab` command. Thin: each capability registers its own commands from its package
(`<package>/commands.py`, a `register(app)` function), and imports its heavy parts lazily so
that `accelab --help` stays fast."""

from __future__ import annotations

import importlib
import logging
import os

import typer

app = typer.Typer(
    name="accelab",
    help="Make Hugging Face / PyTorch models measurably faster, and prove their outputs did not get worse.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# One line per capability; each module defines register(app).
COMMAND_MODULES = [
    "accelab.catalog.commands",  # models list / fetch
    "accelab.measure.commands",  # env
    "accelab.benchmark.commands",  # bench, compare, verify
    "accelab.tuner.commands",  # tune
    "accelab.predict.commands",  # predict
    "accelab.report.commands",  # history, report, regress
    "accelab.train.commands",  # train
    "accelab.serve.commands",  # serve
    "accelab.loadtest.commands",  # loadtest
    "accelab.monitor.commands",  # top
]


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log each step."),
    offline: bool = typer.Option(
        False,
        "--offline",
        help="Never download: Hub models come from the local Hugging Face cache only (the same as HF_HUB_OFFLINE=1).",
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Let Hub models run the Python code of their repository (read it first); off by default.",
    ),
) -> None:
    # what the user asked for goes where every process of this run (the measuring children
    # too) and huggingface_hub read it: the environment
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    if trust_remote_code:
        os.environ["ACCELAB_TRUST_REMOTE_CODE"] = "1"
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


def main() -> None:
    from accelab.entry import run_app

    run_app(app)
