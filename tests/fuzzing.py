"""schemathesis against real servers, one copy for the bounded fuzz of `make test`
(tests/test_serve_fuzz.py) and the long one (benchmarks/fuzz_long.py): the route families, the
server of a family, the `st run` command, and the seed.

The seed comes from the commit (its first 8 hex digits as a number), so a rerun of one commit
sends the same requests and another commit explores others; ACCELAB_FUZZ_SEED overrides it, to
rerun what a log shows. `python tests/fuzzing.py` says the seed on stderr and prints the number:
`make test` runs it once and hands the number to every fuzz test through ACCELAB_FUZZ_SEED, so its
log names the seed they used even if HEAD moves during the run."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ST = Path(sys.executable).parent / "st"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
SEED_ENV = "ACCELAB_FUZZ_SEED"
FALLBACK_SEED = 1  # no commit to derive it from (no git, not a checkout): the seed make test always used before


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """A server and the routes of it that one fuzz run covers."""

    model: str
    plan: str
    routes: str  # st's --include-path-regex
    seconds: int  # the bounded run's time budget (make test)


FAMILIES = {
    "generation-torch": Family(model="smollm2-135m", plan="baseline", routes="^/v1/(chat/)?completions$", seconds=45),
    "generation-llamacpp": Family(
        model="smollm2-135m", plan="llamacpp", routes="^/v1/(chat/)?completions$", seconds=30
    ),
    "embeddings": Family(
        model="minilm-l6",
        plan="baseline",
        routes="^/v1/embeddings$|^/(readyz|health|livez|metrics|v1/models)$",
        seconds=20,
    ),
    "classification": Family(model="vit-tiny", plan="baseline", routes="^/v1/classify$", seconds=20),
}


# -- the seed ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class FuzzSeed:
    value: int
    source: str  # where it came from, for the log

    def __str__(self) -> str:
        return f"fuzz seed: {self.value} ({self.source}; {SEED_ENV}={self.value} reruns it)"


def run_seed(environ: Mapping[str, str], commit: str | None) -> FuzzSeed:
    """The seed of a run: ACCELAB_FUZZ_SEED when set, else the commit's, else FALLBACK_SEED."""
    override = environ.get(SEED_ENV, "").strip()
    if override:
        if not override.isdecimal():
            raise ValueError(
                f"{SEED_ENV}={override!r} is not a seed: give the number a fuzz log names ('fuzz seed: N')"
            )
        return FuzzSeed(value=int(override), source=f"from {SEED_ENV}")
    if commit is None:
        return FuzzSeed(value=FALLBACK_SEED, source="no git commit here: the fixed fallback")
    return FuzzSeed(value=int(commit[:8], 16), source=f"from commit {commit[:12]}")


def head_commit(root: Path = ROOT) -> str | None:
    """HEAD's commit id, None where there is no git or no commit."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", commit) else None


# -- a server and the command --------------------------------------------------------------------
@contextlib.contextmanager
def serve_family(name: str) -> Iterator[str]:
    """A family's server in this process (its model already fetched); yields its base URL."""
    import torch
    from serving import running_server

    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.app import create_app
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import engine_factory

    family = FAMILIES[name]
    factory = engine_factory(
        resolve(family.model, fetch=False), load_plan(family.plan), torch.device("cpu"), name=family.model
    )
    config = ServeConfig(model_name=family.model, max_tokens=16, max_batch_size=4)
    with running_server(create_app(config, factory), ready_timeout_s=300) as url:
        yield url


def st_command(
    url: str, name: str, *, seed: int, max_time: int | None = None, max_examples: int | None = None
) -> list[str]:
    """`st run` against a family's routes on the server at `url`, bounded by time and/or by
    examples per operation."""
    budget = [
        *(["--max-time", str(max_time)] if max_time else []),
        *(["--max-examples", str(max_examples)] if max_examples else []),
    ]
    return [
        str(ST), "run", f"{url}/openapi.json",
        "--checks", CHECKS,
        "--include-path-regex", FAMILIES[name].routes,
        "--request-timeout", "300",  # a long generated prompt on a busy machine may take minutes
        "--seed", str(seed),
        "--no-color",
        *budget,
    ]  # fmt: skip


def main() -> None:
    try:
        seed = run_seed(os.environ, head_commit())
    except ValueError as err:
        sys.exit(f"error: {err}")
    print(seed, file=sys.stderr)
    print(seed.value)


if __name__ == "__main__":
    main()
