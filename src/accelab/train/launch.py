"""Start the worker processes of one training run and wait for them (`accelab.launch` starts,
watches and stops them).

One process: `python -m accelab.train.worker CONFIG.json`. Several (`--nproc`, `--nnodes`):
torchrun; the ranks use gloo on CPUs (the worker's `Accelerator(cpu=True)`) and NCCL on GPUs.
Multi-node: run the same `accelab train ...` command on every node with its `--node-rank`;
checkpoints and the saved model are written by global rank 0, and resuming needs the output
directory on a filesystem every node sees.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from accelab.launch import LaunchOptions, Outcome, run_workers, worker_command
from accelab.train.config import TrainConfig

WORKER_MODULE = "accelab.train.worker"


def run(config: TrainConfig, launch: LaunchOptions, *, timeout_s: float) -> Outcome:
    """Write the config, start the worker(s), wait; the outcome with rank 0's summary.

    The run directory keeps train_config.json (and rank 0 writes train_result.json beside it),
    but what the workers read and report goes through this process's own temporary files: on a
    disk shared by several nodes, each node's launcher then reads only its own ranks' report."""
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    _write_atomically(output / "train_config.json", config.to_dict())
    with tempfile.TemporaryDirectory(prefix="accelab-train-") as private:
        result_path = Path(config.result_path or Path(private) / "train_result.json")
        result_path.unlink(missing_ok=True)
        config_path = Path(private) / "train_config.json"
        config_path.write_text(json.dumps(config.with_changes(result_path=str(result_path)).to_dict(), indent=2))
        return run_workers(
            worker_command(WORKER_MODULE, config_path, launch),
            summary_path=result_path,
            threads=config.threads,
            timeout_s=timeout_s,
            what="training",
        )


def _write_atomically(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
