"""The worker entry: one training run in this process (one rank of it under torchrun).

    python -m accelab.train.worker CONFIG.json                      # one process
    torchrun --nproc_per_node 2 -m accelab.train.worker CONFIG.json # data-parallel

`accelab train` writes CONFIG.json (a TrainConfig) and starts this; the main process writes
the run's summary to `config.result_path`. Exit codes: 0 ok, 2 a user error (the message says
how to fix it), 3 unsupported on this device.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from accelab.catalog.store import register_local_model
from accelab.launch import EXIT_USER_ERROR, exit_worker, run_worker, start_worker
from accelab.measure.memory import PeakMemorySampler
from accelab.train import loop
from accelab.train.accel import Unsupported, uses_cuda
from accelab.train.config import TrainConfig
from accelab.train.fsdp import training_state_bytes
from accelab.train.progress import progress_for
from accelab.train.step_split import StepSplit, comm_of
from accelab.train.timing import StepTimer

log = logging.getLogger(__name__)

FINAL_MODEL = "model"

# This process's training sessions, kept until it exits: under torchrun the rank leaves by os._exit
# (`exit_worker`) without freeing them, because freeing DDP's reducer destroys the gloo process
# group it holds, and that destructor joins gloo's threads, which can wait forever once another
# rank has left (seen as a rank that never exits after rank 0 wrote the result).
_SESSIONS: list[Any] = []


def train(config: TrainConfig) -> dict[str, Any] | None:
    """Run the training; the summary on the main process, None on the others."""
    session = loop.setup(config)
    if config.world_size > 1:
        _SESSIONS.append(session)
    accelerator = session.accelerator
    try:
        if config.log_with != "none":
            accelerator.init_trackers("accelab-train", config=_tracker_config(config))
        start = loop.resume(session)
        sync = loop.cuda_sync(session)
        comm = comm_of(config.world_size, config.sharding)
        split = StepSplit(sync=sync, comm=comm) if config.step_breakdown else None  # bench rows
        timer = StepTimer(warmup=config.timing_warmup, sync=sync, split=split)
        device = accelerator.device if uses_cuda(config) else "cpu"
        with PeakMemorySampler(device=device, interval=0.02) as memory, progress_for(session, start) as bar:
            timer.start()
            record = loop.run_epochs(session, start, timer, bar)
        final_dir = Path(config.output_dir) / FINAL_MODEL
        if config.save_final or config.save_as:
            loop.save_model(session, final_dir)
        peaks = _gather_peaks(session, memory.report)
        summary = _summary(session, start, record, timer, peaks, final_dir)
        if accelerator.is_main_process and config.save_as:
            summary["saved_model"] = str(_register(session, summary, final_dir))
        # every rank leaves the group together: none tears it down while another still works
        accelerator.wait_for_everyone()
        return summary if accelerator.is_main_process else None
    finally:
        accelerator.end_training()


def _tracker_config(config: TrainConfig) -> dict[str, Any]:
    """Hyperparameters as TensorBoard accepts them (scalars and strings, no None)."""
    return {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool))}


def _gather_peaks(session: Any, report: Any) -> dict[str, Any]:
    """Per rank: peak RSS (each process's own, shared pages counted in each), on GPUs torch's
    peak allocation on the rank's device, and the training state the rank holds (parameters,
    gradients, optimizer state: its shards under FSDP). RSS on CPU also counts the interpreter,
    the libraries and the full model each rank loads before sharding; the state is the
    deterministic figure that shows what sharding saves."""
    accelerator = session.accelerator
    gpu = report.gpu_peak_allocated_mb if report.gpu_peak_allocated_mb is not None else -1.0
    state_mb = training_state_bytes(session.model, session.optimizer) / 2**20
    local = torch.tensor([[report.peak_rss_mb, gpu, state_mb]], dtype=torch.float64, device=accelerator.device)
    rows = accelerator.gather(local).cpu().tolist()  # [world_size, 3]
    rss = [r[0] for r in rows]
    gpus = [r[1] for r in rows if r[1] >= 0]
    state = [r[2] for r in rows]
    return {
        "peak_rss_mb_per_rank": rss,
        "peak_rss_mb_max": max(rss),
        "peak_rss_mb_sum": sum(rss),
        "gpu_peak_allocated_mb_per_rank": gpus or None,
        "gpu_peak_allocated_mb_max": max(gpus) if gpus else None,
        "state_mb_per_rank": state,
        "state_mb_max": max(state),
    }


def _summary(session: Any, start: Any, record: Any, timer: Any, peaks: dict[str, Any], final_dir: Path) -> dict:
    config, accelerator = session.config, session.accelerator
    final = record.evals[-1] if record.evals else {}
    return {
        "status": "ok",
        "world_size": accelerator.num_processes,
        "per_process_batch": config.per_process_batch,
        "device": str(accelerator.device),
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision,
        "native_amp": bool(accelerator.native_amp),
        "threads": torch.get_num_threads(),
        "steps_per_epoch": session.steps_per_epoch,
        "total_steps": session.total_steps,
        "resumed_at_step": start.global_step,
        "train_samples": len(session.data.train),
        "eval_samples": len(session.data.eval),
        "eval_split": session.data.eval_split,
        "class_names": session.data.class_names,
        "image_size": session.loaded.image_size,
        "skipped_images": session.data.skipped,
        "skipped_steps": record.skipped_steps,
        "losses": record.losses,
        "lrs": record.lrs,
        "evals": record.evals,
        "final": final,
        "timing": timer.summary(config.batch_size, session.steps_per_epoch, record.full_epochs),
        "memory": peaks,
        "notes": list(session.loaded.notes),
        "final_model_dir": str(final_dir),
        "dataset_meta": session.data.meta,
    }


def _register(session: Any, summary: dict[str, Any], final_dir: Path) -> Path:
    config = session.config
    final = summary["final"]
    metrics = (
        {"test_accuracy": final.get("accuracy"), "test_loss": final.get("loss")}
        if config.task == "image-classification"
        else {"eval_perplexity": final.get("perplexity"), "eval_loss": final.get("loss")}
    )
    origin = (
        f"accelab train {config.model} on {summary['dataset_meta'].get('dataset')} "
        f"({summary['total_steps']} steps, global batch {config.batch_size})"
    )
    extra = {
        **summary["dataset_meta"],
        "base_model": config.model,
        "eval_split": summary["eval_split"],
        "train_run": config.output_dir,
    }
    return register_local_model(
        config.save_as, final_dir, task=config.task, origin=origin, metrics=metrics, extra_meta=extra
    )


def _write(config: TrainConfig, doc: dict[str, Any]) -> None:
    """Rank 0's report: to the launcher's file, and a copy in the run directory for the record."""
    text = json.dumps(doc, indent=2, default=str) + "\n"
    if config.result_path:
        Path(config.result_path).write_text(text)
    if config.output_dir and Path(config.output_dir).is_dir():
        (Path(config.output_dir) / "train_result.json").write_text(text)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m accelab.train.worker CONFIG.json (written by `accelab train`)", file=sys.stderr)
        return EXIT_USER_ERROR
    start_worker()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    config = TrainConfig.from_dict(json.loads(Path(args[0]).read_text()))
    rank = _rank()
    if rank != 0:
        logging.getLogger("accelab").setLevel(logging.ERROR)  # one copy of each warning, from rank 0
    return run_worker(
        lambda: train(config),
        rank=rank,
        world_size=config.world_size,
        write=lambda doc: _write(config, doc),
        unsupported=Unsupported,
    )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    exit_worker(main())
