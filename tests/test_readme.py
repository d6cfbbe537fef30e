"""The README and the manual's pages (docs/): set-up is `make demo` + `make test`, every accelab
command they show parses with today's options, the quick ones run for real, and the README stays
a front page that links every page."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}


def code_blocks(text, languages=("", "bash", "console", "sh")):
    """The fenced blocks in those languages (a fence opens at the start of a line)."""
    return [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M) if lang in languages]


def readme_commands(text=README):
    """`accelab ...` lines of a page (a leading `$ ` is a prompt; `\\` joins lines)."""
    commands = []
    for block in code_blocks(text):
        joined = block.replace("\\\n", " ")
        for raw in joined.splitlines():
            line = raw.strip().removeprefix("$ ").split(" #")[0].strip()
            line = line.split(" | ")[0].split(" &")[0].strip()
            if line.startswith("accelab "):
                commands.append(shlex.split(line)[1:])
    return commands


def test_setup_is_two_make_commands():
    first = code_blocks(README)[0]
    lines = [line.split("#")[0].strip() for line in first.strip().splitlines()]
    assert lines == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    dry = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    # on a fresh machine: torch pinned first, then accelab, then the offline models, then the demo
    if "torch==2.13.0" in dry:
        assert dry.index("torch==2.13.0") < dry.index('-e ".[test')
    assert "accelab models fetch --all" in dry and "examples/demo.sh" in dry
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_is_a_front_page_that_links_every_page_of_the_manual():
    lines = README.count("\n")
    assert lines <= 400, f"README.md has {lines} lines: the manual's text goes in docs/"
    assert set(PAGES) >= {"serving.md", "training.md", "runtimes.md", "measurement.md", "development.md"}
    for name in PAGES:
        assert f"(docs/{name})" in README, f"README does not link docs/{name}"
    assert "Where the time goes" not in README  # the suite's time lives in docs/development.md alone


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{name}" for name in PAGES)])
def test_every_command_of_the_readme_and_the_manual_parses(page):
    from accelab.cli import app

    command = typer.main.get_command(app)
    commands = readme_commands(README if page == "README.md" else PAGES[page.removeprefix("docs/")])
    if page == "README.md":
        assert len(commands) >= 10, "the tour shows the main commands"
    elif page in ("docs/serving.md", "docs/measurement.md", "docs/training.md"):
        assert len(commands) >= 5, f"{page} shows its commands"
    root = click.Context(command)
    for args in commands:
        group = command.get_command(root, args[0])
        assert group is not None, f"{page} shows an unknown command: accelab {' '.join(args)}"
        rest = list(args[1:])
        if isinstance(group, click.Group):  # e.g. `models list`
            leaf = group.get_command(click.Context(group, parent=root), rest[0])
            assert leaf is not None, f"unknown subcommand in {page}: accelab {' '.join(args)}"
            group, rest = leaf, rest[1:]
        group.make_context(args[0], rest)  # raises on an unknown option or a bad value


@pytest.mark.slow
def test_quick_readme_commands_run(tmp_path):
    env_json = tmp_path / "env.json"
    for args in (["env", "--json", str(env_json)], ["models", "list"]):
        proc = subprocess.run(
            [sys.executable, "-m", "accelab", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "COLUMNS": "200"},
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
    assert "minilm-l6" in proc.stdout and "smollm2-135m" in proc.stdout
    report = json.loads(env_json.read_text())
    statuses = {cap["technique"]: cap["status"] for cap in report["capabilities"]}
    assert statuses["fp16-autocast"] == "unsupported" and set(statuses.values()) <= {"ok", "slow", "unsupported"}
