"""Silencing third-party chatter that says nothing to an accelab user, for a whole process.

Process-wide on purpose, and so called only at process entry points, each of which says so:
`entry.run_app` (the `accelab` command and every `python -m accelab.<capability>`), the measuring
child of `measure/runner.py`, and the predict worker. Not a context manager: the libraries read
these variables when they are imported (and child processes inherit them), after which restoring
them would undo nothing.

What it writes: the environment variables of `QUIET_ENV` that the user has not set (a value the
user set, even an empty one, is left as it is), and the levels of the loggers in `NOISY_LOGGERS`.
No warnings filters.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # download bars in logs; catalog/hub.py shows its own on a terminal
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",  # else tokenizers warns when a process that used it forks
}

# loggers that warn about optional kernels this machine does not have, or about deprecations
NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "transformers.modeling_utils", "accelerate.utils.other")


def set_quiet_env_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Sets each variable of `QUIET_ENV` that `environ` lacks; returns the ones it set."""
    added = {name: value for name, value in QUIET_ENV.items() if name not in environ}
    environ.update(added)
    return added


def lower_third_party_log_levels() -> None:
    """ERROR for `NOISY_LOGGERS`; huggingface_hub's records stay with its own stderr handler."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # huggingface_hub writes its warnings (a download that resumes) with its own stderr handler;
    # passed on to the root logger too, each would print twice
    logging.getLogger("huggingface_hub").propagate = False


def quiet_third_party_process_wide() -> None:
    """At a process entry point only: `set_quiet_env_defaults()` and `lower_third_party_log_levels()`."""
    set_quiet_env_defaults()
    lower_third_party_log_levels()
