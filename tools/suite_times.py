"""Where the test suite's time goes: the slowest tests and files of a pytest run, the tests over
their time budget for the CPU kind the run was on, and the wall time of each install step of
`make test`, as the Markdown tables of docs/development.md.

    python tools/suite_times.py JUNIT_XML [--installs TIMES] [--top 25] [--cpu avx2|avx512|avx512_bf16|amx]

The CI machines change CPU from run to run, and the suite must pass within CI's limit on the
slowest of them: BUDGETS holds, per CPU kind, the most one test may take (its set-up, call and
tear-down, beside the other worker) and the whole suite's test time on two workers. `--cpu`
defaults to this machine's kind (`accelab.cpu.current`: name the kind of the machine the run
was on when reading another's file).

JUNIT_XML is a pytest run's `--junitxml` file (each test's time is its set-up, call and
tear-down together); TIMES has one `target seconds` line per make target, as
`tools/install_times.sh` writes it. docs/development.md's tables came from

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

from accelab import cpu


@dataclass(frozen=True, slots=True)
class Budget:
    test_s: float  # the most one test may take
    suite_min: float  # pytest's wall time on two workers (CI's limit is 90 minutes with the installs)


# An AVX2-only CPU emulates bf16 and compiles slower: its tests get more time each, the suite the same
# total (tests pick the precision the CPU runs natively unless the precision is what they test).
BUDGETS: dict[str, Budget] = {
    "avx2": Budget(test_s=150, suite_min=30),
    "avx512": Budget(test_s=120, suite_min=28),
    "avx512_bf16": Budget(test_s=120, suite_min=28),
    "amx": Budget(test_s=120, suite_min=28),
}


@dataclass(frozen=True, slots=True)
class TestTime:
    file: str
    name: str
    seconds: float
    cpu_s: float | None = None  # its process's and its ended children's CPU (tests/conftest.py)


def read_junit(path: Path) -> list[TestTime]:
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        cpu_s = next((float(p.get("value", 0)) for p in case.iter("property") if p.get("name") == "cpu_s"), None)
        tests.append(TestTime(f"tests/{module}.py", case.get("name", ""), float(case.get("time", 0.0)), cpu_s))
    return tests


def over_budget(tests: list[TestTime], kind: str) -> list[TestTime]:
    """The tests that took longer than the budget of one test on a CPU of `kind`, slowest first."""
    budget = BUDGETS[kind].test_s
    return sorted((t for t in tests if t.seconds > budget), key=lambda t: -t.seconds)


def budget_lines(tests: list[TestTime], kind: str, wall_min: float | None) -> list[str]:
    budget = BUDGETS[kind]
    lines = ["", "| CPU kind | budget a test | budget of the suite (2 workers) |", "|---|---:|---:|"]
    lines += [
        f"| {k}{' (this run)' if k == kind else ''} | {b.test_s:g} s | {b.suite_min:g} min |"
        for k, b in BUDGETS.items()
    ]
    over = over_budget(tests, kind)
    lines += ["", f"{len(over)} tests over {budget.test_s:g} s on {kind}" + (":" if over else ".")]
    lines += [f"- {t.seconds:.1f} s `{t.file}::{t.name}`" for t in over]
    if wall_min is not None:
        verdict = "within" if wall_min <= budget.suite_min else "OVER"
        lines.append(f"suite: {wall_min:.1f} min on two workers, {verdict} its {budget.suite_min:g} min on {kind}")
    return lines


def tables(
    tests: list[TestTime],
    installs: list[tuple[str, float]],
    top: int,
    kind: str | None = None,
    wall_min: float | None = None,
) -> str:
    total = sum(t.seconds for t in tests)
    lines = [f"{len(tests)} tests, {total / 60:.1f} min of test time in all", ""]
    lines += ["| seconds | slowest tests |", "|---:|---|"]
    for t in sorted(tests, key=lambda t: -t.seconds)[:top]:
        lines.append(f"| {t.seconds:.1f} | `{t.file}::{t.name}` |")
    per_file: defaultdict[str, float] = defaultdict(float)
    cpu_file: defaultdict[str, float] = defaultdict(float)
    for t in tests:
        per_file[t.file] += t.seconds
        cpu_file[t.file] += t.cpu_s or 0.0
    lines += ["", "| seconds | slowest files |", "|---:|---|"]
    slowest = sorted(per_file.items(), key=lambda kv: -kv[1])[:10]
    lines += [f"| {s:.1f} | `{f}` |" for f, s in slowest]
    if any(t.cpu_s is not None for t in tests):  # on 2 cores the suite is bound by CPU: what to cut first
        lines += ["", f"{sum(cpu_file.values()) / 60:.1f} CPU-minutes in all (the tests' and their ended children's)"]
        lines += ["", "| CPU seconds | files using the most CPU |", "|---:|---|"]
        lines += [f"| {s:.0f} | `{f}` |" for f, s in sorted(cpu_file.items(), key=lambda kv: -kv[1])[:top]]
    if kind is not None:
        lines += budget_lines(tests, kind, wall_min)
    if installs:
        lines += ["", "| seconds | install step (make target) |", "|---:|---|"]
        lines += [f"| {s:.0f} | `make {target}` |" for target, s in installs]
    return "\n".join(lines)


def read_wall_minutes(path: Path) -> float | None:
    """The run's wall time from the junit file's test suite (pytest writes its duration there)."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    seconds = suite.get("time") if suite is not None else None
    return float(seconds) / 60 if seconds else None


def read_installs(path: Path) -> list[tuple[str, float]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            *target, seconds = line.split()  # `make` arguments, then seconds
            rows.append((" ".join(target), float(seconds)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--installs", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cpu", choices=list(BUDGETS), default=None, help="the run's CPU kind (default: this one's)")
    args = parser.parse_args(argv)
    installs = read_installs(args.installs) if args.installs else []
    tests = read_junit(args.junit)
    print(tables(tests, installs, args.top, args.cpu or cpu.current(), read_wall_minutes(args.junit)))


if __name__ == "__main__":
    main()
