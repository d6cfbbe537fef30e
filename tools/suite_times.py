"""Where the test suite's time goes: the slowest tests and files of a pytest run, and the wall
time of each install step of `make test`, as the Markdown tables of the README's Development
section.

    python tools/suite_times.py JUNIT_XML [--installs TIMES] [--top 25]

JUNIT_XML is a pytest run's `--junitxml` file (each test's time is its set-up, call and
tear-down together); TIMES has one `target seconds` line per make target, as
`tools/install_times.sh` writes it. The README's tables came from

    bash tools/install_times.sh /tmp/installs.txt   # in a fresh clone: each make target, timed
    make test PYTEST_ARGS="--junitxml=/tmp/suite.xml"
    python tools/suite_times.py /tmp/suite.xml --installs /tmp/installs.txt
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TestTime:
    file: str
    name: str
    seconds: float


def read_junit(path: Path) -> list[TestTime]:
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        tests.append(TestTime(f"tests/{module}.py", case.get("name", ""), float(case.get("time", 0.0))))
    return tests


def tables(tests: list[TestTime], installs: list[tuple[str, float]], top: int) -> str:
    total = sum(t.seconds for t in tests)
    lines = [f"{len(tests)} tests, {total / 60:.1f} min of test time in all", ""]
    lines += ["| seconds | slowest tests |", "|---:|---|"]
    for t in sorted(tests, key=lambda t: -t.seconds)[:top]:
        lines.append(f"| {t.seconds:.1f} | `{t.file}::{t.name}` |")
    per_file: defaultdict[str, float] = defaultdict(float)
    for t in tests:
        per_file[t.file] += t.seconds
    lines += ["", "| seconds | slowest files |", "|---:|---|"]
    slowest = sorted(per_file.items(), key=lambda kv: -kv[1])[:10]
    lines += [f"| {s:.1f} | `{f}` |" for f, s in slowest]
    if installs:
        lines += ["", "| seconds | install step (make target) |", "|---:|---|"]
        lines += [f"| {s:.0f} | `make {target}` |" for target, s in installs]
    return "\n".join(lines)


def read_installs(path: Path) -> list[tuple[str, float]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            target, seconds = line.split()[:2]
            rows.append((target, float(seconds)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--installs", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    installs = read_installs(args.installs) if args.installs else []
    print(tables(read_junit(args.junit), installs, args.top))


if __name__ == "__main__":
    main()
