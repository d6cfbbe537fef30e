"""One rank of a predict run (the only one, when there is one process).

    python -m accelab.predict.worker CONFIG.json                       # one process
    torchrun --nproc_per_node 2 -m accelab.predict.worker CONFIG.json  # data parallel

`accelab predict` writes CONFIG.json (a PredictConfig) and runs this; global rank 0 writes the
run's summary to `config.summary_path`. The recipe:
1. join the process group (none for one process; NCCL on GPUs, gloo on CPUs);
2. open the source: every rank lists the same items in the same order;
3. rank 0 plans the work left (items not in finished chunk files) and broadcasts it;
4. load the model with the plan (`runtimes.load_runnable`);
5. run this rank's chunks: DataLoader workers decode and preprocess, the model predicts, each
   finished chunk is written atomically to the parts directory;
6. gather the per-rank figures; rank 0 merges the chunks into the output in input order.
Exit codes: 0 ok, 2 a user error (the message says how to fix it), 3 unsupported on this device.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from accelab import runtimes  # looked up per call: tests/faults replaces runtimes.load_runnable
from accelab.catalog.spec import ModelSpec
from accelab.launch import EXIT_USER_ERROR, exit_worker, run_worker, start_worker
from accelab.measure.memory import PeakMemorySampler, process_cpu_seconds_reader, process_rss_reader
from accelab.plan.apply import resolve_device
from accelab.plan.plan import Plan
from accelab.plan.runtime import Unsupported, input_device, to_device
from accelab.predict import dist
from accelab.predict.chunks import Chunk, WorkPlan, plan_work
from accelab.predict.config import PredictConfig
from accelab.predict.outputs import merge
from accelab.predict.parts import Parts
from accelab.predict.pipeline import make_loader
from accelab.predict.progress import progress_bar
from accelab.predict.sources import ItemKind, Source, open_source
from accelab.predict.tasks import make_handler
from accelab.quiet import quiet_third_party_process_wide

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.05  # RSS sampling; a run lasts seconds to hours


@dataclass(frozen=True, kw_only=True, slots=True)
class RankStats:
    """What one rank did in this attempt (gathered to rank 0)."""

    rank: int
    device: str
    threads: int
    workers: int
    items: int  # inputs handled: predicted + skipped
    skipped: int
    batches: int
    wall_s: float  # first batch asked for -> last chunk written
    compute_s: float  # copy to the device, model, postprocessing up to the sync that brings results back
    wait_s: float  # blocked on the DataLoader (decoding / preprocessing not keeping up)
    write_s: float  # writing chunk files
    peak_rss_mb: float  # this process (DataLoader workers left out: they share its pages)
    cpu_util_fraction: float  # this process and its DataLoader workers, over the CPUs it may use
    gpu_util_percent: float | None
    gpu_peak_allocated_mb: float | None

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s > 0 else 0.0


def run(config: PredictConfig, group: dist.Group | None = None) -> dict[str, Any] | None:
    """The whole run on this rank; the summary on global rank 0, None on the others."""
    cuda = _wants_cuda(config)
    group = group or dist.start(cpu=not cuda, timeout_s=config.timeout_s)
    try:
        if group.world_size != config.world_size:
            raise ValueError(
                f"this run was planned for {config.world_size} process(es) but {group.world_size} "
                "started; start it with `accelab predict --nproc/--nnodes`, not by hand"
            )
        device = _device(config, group, cuda)
        # 2. the same items on every rank
        source = _open(config)
        # 3. rank 0 plans what is left, everyone gets the same plan
        work = group.broadcast(_plan(config, source) if group.is_main else None)
        # 4. model and plan
        spec, plan = ModelSpec.from_dict(config.spec), Plan.from_dict(config.plan)
        log.info("rank %d: loading %s with plan %s on %s", group.rank, spec.name, plan.name, device)
        with runtimes.load_runnable(spec, plan, device) as runnable:
            # 5. this rank's chunks
            stats = _run_chunks(config, source, work.for_rank(group.rank), runnable, group, device)
            notes = list(runnable.notes)
        # 6. gather, then merge on rank 0 (the final gather is the barrier: every chunk is on disk)
        all_stats = group.all_gather(stats)
        if not group.is_main:
            return None
        return _finish(config, source, work, all_stats, notes)
    finally:
        group.close()


def _wants_cuda(config: PredictConfig) -> bool:
    return config.device != "cpu" and torch.cuda.is_available()


def _device(config: PredictConfig, group: dist.Group, cuda: bool) -> torch.device:
    if isinstance(group, dist.Distributed):
        return group.device if cuda else torch.device("cpu")  # one GPU per local rank
    return resolve_device(Plan.from_dict(config.plan), config.device)


def _open(config: PredictConfig) -> Source:
    want: ItemKind = "image" if config.task in ("image-classification", "image-text-to-text") else "text"
    source = open_source(
        config.source,
        want=want,
        text_field=config.text_field,
        split=config.split,
        limit=config.limit,
    )
    if len(source) != config.source_items or source.digest() != config.source_digest:
        raise ValueError(
            f"--inputs {config.source} changed after the run started ({len(source)} items now, "
            f"{config.source_items} before); rerun the command"
        )
    return source


def _plan(config: PredictConfig, source: Source) -> WorkPlan:
    parts = Parts(config.out)
    identity = config.identity()
    parts.check_compatible(identity)
    done = parts.done_indices() if parts.exists() else set()
    attempt = parts.begin_attempt(
        identity,
        {
            "world_size": config.world_size,
            "batch_size": config.batch_size,
            "chunk_size": config.chunk_size,
            "done_before": len(done),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )
    work = plan_work(
        total=len(source),
        done=done,
        lengths=source.lengths(),
        chunk_size=config.chunk_size,
        world_size=config.world_size,
        attempt=attempt,
    )
    if done:
        log.warning(
            "resuming: %d of %d items are done; %d left in %d chunk(s)",
            len(done),
            len(source),
            work.remaining,
            len(work.chunks),
        )
    return work


class _ChunkFiles:
    """Rows of the chunks in flight; a chunk's file is written the moment its last row arrives."""

    def __init__(self, out: str, ids: list[Any]):
        self.parts, self.ids = Parts(out), ids
        self.pending: dict[int, list[dict[str, Any]]] = {}
        self.skipped = 0

    def add(self, chunk: Chunk, indices: list[int], rows: list[dict[str, Any]], skipped: list[tuple[int, str]]) -> None:
        out = self.pending.setdefault(chunk.number, [])
        out.extend({"index": i, "id": self.ids[i], **row} for i, row in zip(indices, rows))
        out.extend({"index": i, "id": self.ids[i], "skipped": why} for i, why in skipped)
        self.skipped += len(skipped)
        if len(out) == len(chunk.indices):
            self.parts.write_chunk(chunk, self.pending.pop(chunk.number))


def _run_chunks(
    config: PredictConfig, source: Source, chunks: list[Chunk], runnable: Any, group: dist.Group, device: torch.device
) -> RankStats:
    handler = make_handler(config, runnable)
    planned = [(chunk, batch) for chunk in chunks for batch in chunk.batches(config.batch_size)]
    loader = make_loader(
        source,
        [batch for _, batch in planned],
        handler.encode,
        workers=config.workers,
        pin_memory=device.type == "cuda",
    )
    target = input_device(runnable.model, device)
    files = _ChunkFiles(config.out, source.ids)
    total = sum(len(c.indices) for c in chunks)
    label = "predict" if group.world_size == 1 else f"predict (rank 0's share, 1/{group.world_size})"
    with (
        _rank_memory(device) as memory,
        progress_bar(total, label, enabled=config.progress and group.is_main) as advance,
    ):
        start = time.perf_counter()
        batches = iter(loader)
        wait, compute, write = _predict_batches(
            planned, batches, lambda batch: handler.predict(runnable, to_device(batch.tensors, target)), files, advance
        )
        leftover = next(batches, None)  # ends the loader: its workers are joined, so their CPU time counts
        if leftover is not None or files.pending:
            raise AssertionError(f"rank {group.rank}: the loader and the chunk plan disagree")
        wall = time.perf_counter() - start
    report = memory.report
    return RankStats(
        rank=group.rank,
        device=str(device),
        threads=torch.get_num_threads(),
        workers=config.workers,
        items=total,
        skipped=files.skipped,
        batches=len(planned),
        wall_s=wall,
        compute_s=compute,
        wait_s=wait,
        write_s=write,
        peak_rss_mb=report.peak_rss_mb,
        cpu_util_fraction=report.cpu_util_fraction,
        gpu_util_percent=report.gpu_util_percent,
        gpu_peak_allocated_mb=report.gpu_peak_allocated_mb,
    )


def _rank_memory(device: torch.device) -> PeakMemorySampler:
    """RSS of this process only (forked DataLoader workers share its pages); CPU time with the workers'."""
    return PeakMemorySampler(
        device=device,
        interval=SAMPLE_INTERVAL_S,
        rss_reader=process_rss_reader(False),
        cpu_seconds_reader=process_cpu_seconds_reader(True),
    )


def _predict_batches(
    planned: list[tuple[Chunk, list[int]]],
    batches: Iterator[Any],
    predict: Callable[[Any], list],
    files: _ChunkFiles,
    advance: Callable[[int], None],
) -> tuple[float, float, float]:
    """Every planned batch predicted and written to its chunk's file, in plan order: the seconds
    spent waiting on the loader, computing and writing."""
    wait = compute = write = 0.0
    for chunk, indices in planned:
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        rows = predict(batch) if batch.indices else []
        t2 = time.perf_counter()
        files.add(chunk, batch.indices, rows, batch.skipped)
        wait, compute, write = wait + t1 - t0, compute + t2 - t1, write + time.perf_counter() - t2
        advance(len(indices))
    return wait, compute, write


def _finish(
    config: PredictConfig, source: Source, work: WorkPlan, ranks: list[RankStats], notes: list[str]
) -> dict[str, Any]:
    start = time.perf_counter()
    parts = Parts(config.out)
    merged = merge(parts, total=len(source), out=config.out, fmt=config.output_format)
    parts.remove()
    wall = max(r.wall_s for r in ranks)
    processed = sum(r.items for r in ranks)
    return {
        "status": "ok",
        "out": merged.out,
        "output_format": config.output_format,
        "items_total": len(source),
        "rows": merged.rows,
        "skipped": merged.skipped,
        "skipped_path": merged.skipped_path,
        "attempt": work.attempt,
        "done_before": work.done_before,
        "processed": processed,
        "wall_s": wall,
        "items_per_s": processed / wall if wall > 0 else 0.0,
        "merge_s": time.perf_counter() - start,
        "world_size": config.world_size,
        "ranks": [{**asdict(r), "items_per_s": r.items_per_s} for r in ranks],
        "notes": [*source.notes, *notes],
    }


# -- entry point ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m accelab.predict.worker CONFIG.json (written by `accelab predict`)", file=sys.stderr)
        return EXIT_USER_ERROR
    start_worker()  # under torchrun: this rank dies with torchrun's agent
    quiet_third_party_process_wide()  # the worker process's entry point; keeps the variables it inherited
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    config = PredictConfig.from_dict(json.loads(Path(args[0]).read_text()))
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        logging.getLogger("accelab").setLevel(logging.ERROR)  # one copy of each warning

    def write(doc: dict[str, Any]) -> None:
        if config.summary_path:
            Path(config.summary_path).write_text(json.dumps(doc, indent=2, default=str) + "\n")

    return run_worker(
        lambda: run(config), rank=rank, world_size=config.world_size, write=write, unsupported=Unsupported
    )


if __name__ == "__main__":
    exit_worker(main())
