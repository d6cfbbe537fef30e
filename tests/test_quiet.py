"""accelab.quiet: process-wide on purpose, but it never overrides what the user set, and
importing accelab sets nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from accelab.quiet import QUIET_ENV, set_quiet_env_defaults


def test_env_defaults_keep_every_variable_the_user_set_even_empty():
    environ = {"TOKENIZERS_PARALLELISM": "true", "TRANSFORMERS_VERBOSITY": "", "PATH": "/bin"}
    added = set_quiet_env_defaults(environ)
    assert added == {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    assert environ == {"TOKENIZERS_PARALLELISM": "true", "TRANSFORMERS_VERBOSITY": "", "PATH": "/bin", **added}
    assert set_quiet_env_defaults(environ) == {}  # a second call changes nothing


def test_importing_the_cli_writes_no_environment_variable():
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    code = (
        "import os, json; before = dict(os.environ); import accelab.cli; "
        "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}
