"""Silence third-party chatter that says nothing to an accelab user (set once per process)."""

from __future__ import annotations

import logging
import os

# loggers that warn about optional kernels this machine does not have, or about deprecations
_NOISY = ("torchao", "torch.utils._pytree", "transformers.modeling_utils", "accelerate.utils.other")


def quiet_third_party() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.ERROR)
    # huggingface_hub writes its warnings (a download that resumes) with its own stderr handler;
    # passed on to the root logger too, each would print twice
    logging.getLogger("huggingface_hub").propagate = False
