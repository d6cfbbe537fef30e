"""schemathesis fuzzes a real server from its own /openapi.json: requests generated from the
schema (the coverage phase's boundary values, then random ones) against each route family, on
the torch and llama.cpp engines, with schemathesis' checks that no answer is a server error and
that every status, content type and body is the one the schema documents. Each run is bounded in
time; a failure prints schemathesis' report with the curl that reproduces it.

The seed comes from the commit (tests/fuzzing.py), so each commit explores other requests and a
rerun of one sends the same; a failure names its seed, and `make test` prints it first. The long
run, many more examples per operation and several seeds, is benchmarks/fuzz_long.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from fuzzing import FALLBACK_SEED, FAMILIES, ROOT, SEED_ENV, FuzzSeed, head_commit, run_seed, serve_family, st_command

from accelab.catalog.fetch import is_fetched


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_no_generated_request_gets_a_server_error_or_an_undocumented_answer(family):
    if not is_fetched(FAMILIES[family].model):
        pytest.skip(f"run `accelab models fetch {FAMILIES[family].model}` first")
    seed = run_seed(os.environ, head_commit())
    seconds = FAMILIES[family].seconds
    with serve_family(family) as url:
        done = subprocess.run(
            st_command(url, family, seed=seed.value, max_time=seconds),
            capture_output=True,
            text=True,
            timeout=seconds + 600,  # a long generated prompt on a busy machine may take minutes
            check=False,
        )
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"{seed}\n{report[-6000:]}"
    # its summary: no failures (warnings, e.g. a random `model` name answered 404, are not failures)
    assert re.search(r"=+ (No issues found|\d+ warnings?) in [\d.]+s =+", report), f"{seed}\n{report[-3000:]}"
    assert re.search(r"(\d+) generated, \1 passed", report), f"{seed}\n{report[-3000:]}"


def test_the_fuzz_seed_follows_the_commit_and_an_override_wins():
    first, second = "83a01bc" + "0" * 33, "506668b" + "f" * 33
    assert run_seed({}, first) == run_seed({}, first) == FuzzSeed(value=0x83A01BC0, source="from commit 83a01bc00000")
    assert run_seed({}, second).value == 0x506668BF
    assert run_seed({SEED_ENV: " 42 "}, first) == FuzzSeed(value=42, source=f"from {SEED_ENV}")
    assert run_seed({SEED_ENV: ""}, first) == run_seed({}, first)
    assert run_seed({}, None).value == FALLBACK_SEED
    assert (
        str(run_seed({}, first))
        == "fuzz seed: 2208308160 (from commit 83a01bc00000; ACCELAB_FUZZ_SEED=2208308160 reruns it)"
    )
    with pytest.raises(ValueError, match=r"ACCELAB_FUZZ_SEED='-3' is not a seed: give the number a fuzz log names"):
        run_seed({SEED_ENV: "-3"}, first)


def seed_script(**env: str) -> subprocess.CompletedProcess[str]:
    """`python tests/fuzzing.py`, as `make test` runs it, with `env` over this environment less
    ACCELAB_FUZZ_SEED."""
    base = {k: v for k, v in os.environ.items() if k != SEED_ENV}
    return subprocess.run(
        [sys.executable, "tests/fuzzing.py"], cwd=ROOT, env={**base, **env}, capture_output=True, text=True, check=False
    )


def test_make_test_gets_the_seed_from_the_script_that_prints_it():
    """What `make test` runs: the number on stdout (handed to pytest as ACCELAB_FUZZ_SEED), the
    line for the log on stderr; a bad override stops it."""
    done, expected = seed_script(), run_seed({}, head_commit())
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{expected.value}\n", f"{expected}\n")
    done = seed_script(ACCELAB_FUZZ_SEED="7")
    assert (done.stdout, done.stderr) == (
        "7\n",
        "fuzz seed: 7 (from ACCELAB_FUZZ_SEED; ACCELAB_FUZZ_SEED=7 reruns it)\n",
    )
    done = seed_script(ACCELAB_FUZZ_SEED="x")
    assert (done.returncode, done.stdout) == (1, "") and "ACCELAB_FUZZ_SEED='x' is not a seed" in done.stderr
