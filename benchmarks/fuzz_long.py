"""The long fuzz: schemathesis against the servers `make test` fuzzes (the route families of
tests/fuzzing.py), with many more examples per operation and several seeds, where `make test`
spends a few seconds per family on the one seed of its commit.

    python benchmarks/fuzz_long.py                          # every family, 1000 examples, 3 seeds
    python benchmarks/fuzz_long.py --families embeddings --examples 200 --seeds 5
    python benchmarks/fuzz_long.py --families classification --seed 2208308160 --examples 1000

The seeds follow the commit's (ACCELAB_FUZZ_SEED overrides it), one after another; `--seed`
names them instead. For each family and seed it prints the line that reruns exactly that run, then
what schemathesis found: each failure with the curl that reproduces it, also written as
schemathesis' pytest report (`<out>/<family>-<seed>.py`, one standalone test per failing request,
asserting what the server answered then). A finding becomes a regression test: fix the server, then
add the request to the tests of its route (tests/test_serve_http.py, tests/test_openai_fields.py,
...) asserting the answer the schema documents. Exit status 1 when anything was found.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fuzz's servers and command, one copy
from fuzzing import FAMILIES, head_commit, run_seed, serve_family, st_command

from accelab.catalog.fetch import is_fetched

OUT = Path(__file__).parent / "results" / "fuzz_long"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--examples", type=int, default=1000, help="test cases per API operation (st --max-examples)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per family, from the commit's on")
    parser.add_argument("--seed", type=int, action="append", help="a seed to run (repeatable), instead of --seeds")
    parser.add_argument("--max-time", type=int, help="seconds per run at most (st --max-time); default: no cap")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where the reports go (default {OUT})")
    args = parser.parse_args()

    first = run_seed(os.environ, head_commit())
    seeds = args.seed or [first.value + i for i in range(args.seeds)]
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    print(f"{first}; seeds {', '.join(map(str, seeds))}; {args.examples} examples per operation; reports in {out}")
    found = 0
    for family in args.families:
        model = FAMILIES[family].model
        if not is_fetched(model):
            print(f"== {family}: skipped, run `accelab models fetch {model}` first")
            continue
        with serve_family(family) as url:
            for seed in seeds:
                found += fuzz(url, family, seed, args, out)
    print(f"== {found} run(s) with findings" if found else "== no findings")
    return 1 if found else 0


def fuzz(url: str, family: str, seed: int, args: argparse.Namespace, out: Path) -> int:
    """One st run; prints how to rerun it and what it found. 1 if it found anything, else 0."""
    rerun = ["python", "benchmarks/fuzz_long.py", "--families", family, "--seed", str(seed)]
    rerun += ["--examples", str(args.examples), *(["--max-time", str(args.max_time)] if args.max_time else [])]
    print(f"== {family}, seed {seed}; rerun: {shlex.join(rerun)}", flush=True)
    report = out / f"{family}-{seed}.py"
    command = st_command(url, family, seed=seed, max_examples=args.examples, max_time=args.max_time)
    command += ["--report", "pytest", "--report-dir", str(out), "--report-pytest-path", str(report)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    summary = re.findall(r"^=+ .* in [\d.]+s =+$", text, flags=re.MULTILINE)
    print(f"   {time.monotonic() - started:.0f} s; {summary[-1] if summary else 'no summary: st said'}")
    if done.returncode == 0:
        report.unlink(missing_ok=True)  # nothing failed: an empty test file
        return 0
    failures = text.find("FAILURES")
    print(text[failures:] if failures >= 0 else text[-6000:])
    print(f"   as pytest: {report}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
