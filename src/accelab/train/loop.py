"""The training loop on accelerate (runs in every worker process; one Accelerator per process).

Recipe: process settings -> Accelerator -> model -> data -> loaders -> optimizer and LR
schedule -> prepare -> trackers -> resume -> epochs (accumulate, clip, step; evaluate and
checkpoint at epoch ends) -> final model saved by the main process.

Determinism: `set_seed(seed)` before the model is built, a (seed, epoch) data order
(`EpochSampler`), and checkpoints with every rank's RNG state, so that a run resumed from a
checkpoint (optimizer steps already done are skipped with `skip_first_batches`) ends with the
same weights as an uninterrupted run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from accelab.train import checkpoint as ckpt, fsdp, optim, split_probes
from accelab.train.accel import make_accelerator, uses_cuda
from accelab.train.config import TrainConfig, epochs_needed, total_steps
from accelab.train.data import build, class_names
from accelab.train.data_spec import TrainData
from accelab.train.evaluate import evaluate
from accelab.train.model import TrainModel, identity, load_for_training, read_model_config
from accelab.train.sampler import EpochSampler
from accelab.train.timing import StepTimer
from accelab.train.turns import Gate

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Session:
    """Everything prepared for the epochs."""

    config: TrainConfig
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    train_dl: Any
    eval_dl: Any
    sampler: EpochSampler
    data: TrainData
    loaded: TrainModel
    steps_per_epoch: int
    total_steps: int
    identity: dict[str, Any]
    gate: Any = None  # accelab.train.turns.Gate when this run takes turns with other bench rows


@dataclass(kw_only=True, slots=True)
class Position:
    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


def setup(config: TrainConfig) -> Session:
    """The recipe of the module docstring, up to the trackers: everything the epochs need."""
    from accelerate.utils import set_seed

    # Process settings and the Accelerator
    if config.threads:
        torch.set_num_threads(config.threads)
    accelerator = make_accelerator(config)
    set_seed(config.seed)

    # Model (head fitted to the dataset's labels) and data
    classes = class_names(config)
    loaded = load_for_training(config, classes)
    data = build(config, loaded.processor, loaded.image_size)

    # Loaders: the global micro-batch per dataloader batch; accelerate slices it per rank
    sampler = EpochSampler(len(data.train), seed=config.seed, multiple_of=config.batch_size)
    train_dl, eval_dl = _loaders(config, data, sampler)
    steps_per_epoch = len(sampler) // config.batch_size
    total = total_steps(config, steps_per_epoch)

    # Optimizer, LR schedule and prepare (DDP, or FSDP2 sharding)
    model, optimizer, train_dl, eval_dl, scheduler = _prepare(
        config, accelerator, loaded.model, train_dl, eval_dl, total
    )
    num_labels = len(classes) if classes else None
    ident = identity(read_model_config(config.model_source), config.task, num_labels)
    return Session(
        config=config,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_dl=train_dl,
        eval_dl=eval_dl,
        sampler=sampler,
        data=data,
        loaded=loaded,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        identity=ident,
        gate=_gate(config, accelerator.is_main_process, total),
    )


def _loaders(config: TrainConfig, data: TrainData, sampler: EpochSampler) -> tuple[DataLoader, DataLoader]:
    train_dl = DataLoader(
        data.train,
        batch_size=config.loader_batch,
        sampler=sampler,
        drop_last=True,
        num_workers=config.loader_workers,  # worker processes make the batches ahead of the step
        persistent_workers=config.loader_workers > 0,  # kept across epochs: no new processes per epoch
    )
    return train_dl, DataLoader(data.eval, batch_size=config.loader_batch, shuffle=False)


def _prepare(config: TrainConfig, accelerator: Any, model: Any, train_dl: Any, eval_dl: Any, total: int) -> tuple:
    """The model wrapped for data parallelism, the optimizer over its parameters, the loaders and
    schedule through accelerate's prepare."""
    if config.sharding == "fsdp":
        # prepare would DDP-wrap the model: FSDP2 shards it here (fsdp.py); the optimizer is built
        # after, over the sharded parameters, and accelerate prepares everything else
        autocast = accelerator.autocast if config.mixed_precision != "no" else None
        model = fsdp.apply_fsdp(model, config, accelerator.device, autocast)
        optimizer, scheduler = optim.optimizer_and_schedule(config, model, total)
        optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(optimizer, train_dl, eval_dl, scheduler)
        return model, optimizer, train_dl, eval_dl, scheduler
    optimizer, scheduler = optim.optimizer_and_schedule(config, model, total)
    # prepare (inside accelerate, in this order): device placement, autocast forward, DDP wrap, compile
    return accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)


def _gate(config: TrainConfig, main: bool, total: int) -> Gate | None:
    """The turn gate, when this run takes turns with other bench rows (`accelab.train.turns`)."""
    if not (config.turns_dir and config.turns_row):
        return None
    return Gate(
        config.turns_dir,
        config.turns_row,
        main=main,
        seconds_per_turn=config.seconds_per_turn,
        timed_from=config.timing_warmup,
        last_step=total,
    )


def resume(session: Session) -> Position:
    config = session.config
    if not config.resume_from:
        return Position()
    path = Path(config.resume_from)
    state = ckpt.read_state(path)
    warnings = ckpt.check_compatible(
        state,
        path,
        identity=session.identity,
        model=config.model,
        batch_size=config.batch_size,
        seed=config.seed,
        mixed_precision=config.mixed_precision,
    )
    for message in warnings if session.accelerator.is_main_process else []:
        log.warning(message)
    problem = fsdp.checkpoint_problem(path, config.sharding)
    if problem:
        raise ValueError(problem)
    if config.sharding == "fsdp":  # each rank reads its own shards; RNG, scheduler as accelerate saved them
        fsdp.load_checkpoint(path, session.accelerator, session.model, session.optimizer, session.scheduler)
    else:
        session.accelerator.load_state(str(path))
    log.info(
        "resumed from %s at step %d (epoch %d, step %d of it)",
        path,
        state.global_step,
        state.epoch,
        state.step_in_epoch,
    )
    return Position(global_step=state.global_step, epoch=state.epoch, step_in_epoch=state.step_in_epoch)


def save_checkpoint(session: Session, position: Position) -> Path:
    accelerator = session.accelerator
    path = Path(session.config.output_dir) / ckpt.CHECKPOINTS / ckpt.checkpoint_name(position.global_step)
    if session.config.sharding == "fsdp":  # each rank writes its own shards (no model in accelerate's state)
        fsdp.save_checkpoint(path, accelerator, session.model, session.optimizer, session.scheduler)
    else:
        accelerator.save_state(str(path))
    accelerator.wait_for_everyone()  # every rank's RNG file is on disk before the state marks it complete
    if accelerator.is_main_process:
        config = session.config
        ckpt.write_state(
            path,
            ckpt.TrainerState(
                global_step=position.global_step,
                epoch=position.epoch,
                step_in_epoch=position.step_in_epoch,
                identity=session.identity,
                batch_size=config.batch_size,
                seed=config.seed,
                mixed_precision=config.mixed_precision,
                model=config.model,
            ),
        )
    accelerator.wait_for_everyone()
    return path


@dataclass(kw_only=True, slots=True)
class Record:
    """Per-step history and per-epoch evals, kept on every rank (identical: losses are reduced)."""

    losses: list[float]
    lrs: list[float]
    evals: list[dict[str, Any]]
    skipped_steps: int = 0
    full_epochs: list[int] = field(default_factory=list)


def run_epochs(session: Session, start: Position, timer: StepTimer, progress: Any) -> Record:
    config = session.config
    record = Record(losses=[], lrs=[], evals=[])
    position = Position(global_step=start.global_step, epoch=start.epoch, step_in_epoch=start.step_in_epoch)
    for epoch in range(start.epoch, epochs_needed(session.total_steps, session.steps_per_epoch)):
        position.epoch = epoch
        position.step_in_epoch = start.step_in_epoch if epoch == start.epoch else 0
        _one_epoch(session, position, record, timer, progress)
        if position.step_in_epoch == session.steps_per_epoch:  # a full epoch: evaluate, checkpoint
            record.full_epochs.append(epoch)
            with timer.paused():
                _evaluate(session, position, record, progress, timer)
                if config.checkpoints:
                    save_checkpoint(session, Position(global_step=position.global_step, epoch=epoch + 1))
        if position.global_step >= session.total_steps:
            break
    if session.gate is not None:
        session.gate.finish()  # before the final evaluation: the other rows need not wait for it
    if not record.evals or record.evals[-1]["step"] != position.global_step:  # stopped mid-epoch (--max-steps)
        _evaluate(session, position, record, progress, timer)
    return record


def _one_epoch(session: Session, position: Position, record: Record, timer: StepTimer, progress: Any) -> None:
    config, accelerator, model = session.config, session.accelerator, session.model
    session.sampler.set_epoch(position.epoch)  # the epoch's order: f(seed, epoch)
    skip = position.step_in_epoch * config.grad_accum  # dataloader batches already trained on
    loader = accelerator.skip_first_batches(session.train_dl, skip) if skip else session.train_dl
    loader.set_epoch(position.epoch)
    running = torch.zeros((), device=accelerator.device)
    split = timer.split  # where each step's time goes (config.step_breakdown: bench rows); step_split.py
    mark = split.mark if split is not None else lambda phase: None
    try:
        for batch in loader:
            mark("data")
            if split is not None and not split.probed:  # once, before the first forward: comm hook, FLOPs
                with timer.paused():
                    split_probes.probe(split, accelerator, model, batch)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                mark("forward")
                accelerator.backward(loss)  # divides by grad_accum; DDP all-reduces on the last micro-step
                mark("backward")
                running += loss.detach()
                if accelerator.sync_gradients and config.max_grad_norm:
                    _clip_gradients(session, config.max_grad_norm)
                session.optimizer.step()  # skipped by accelerate while accumulating, or on fp16 inf/nan
                session.scheduler.step()  # not stepped when the optimizer step was skipped
                session.optimizer.zero_grad()
                mark("optimizer")
            if not accelerator.sync_gradients:
                continue
            _after_step(session, position, record, running, timer, progress)
            running.zero_()
            if position.global_step >= session.total_steps:
                break
    finally:
        if hasattr(loader, "end"):
            loader.end()  # an early break leaves accelerate's dataloader bookkeeping open


def _after_step(
    session: Session, position: Position, record: Record, running: torch.Tensor, timer: StepTimer, progress: Any
) -> None:
    config, accelerator = session.config, session.accelerator
    position.global_step += 1
    position.step_in_epoch += 1
    record.skipped_steps += int(accelerator.optimizer_step_was_skipped)
    # mean over micro-steps and ranks = the global batch's mean loss (equal shards)
    loss = accelerator.reduce(running / config.grad_accum, reduction="mean").item()  # note: sync point
    seconds = timer.step_done(position.epoch)
    gate = getattr(session, "gate", None)  # Session.gate; stand-ins for a Session (unit tests) may not have it
    if gate is not None and gate.after_step(position.global_step, _slowest(accelerator, seconds)):
        timer.start()  # it waited for its turn: the next step's clock starts now
    lr = session.scheduler.get_last_lr()[0]
    record.losses.append(loss)
    record.lrs.append(lr)
    accelerator.log({"train/loss": loss, "train/lr": lr}, step=position.global_step)
    progress.advance(loss, lr)
    if (
        config.checkpoints
        and config.checkpoint_every
        and position.global_step % config.checkpoint_every == 0
        and position.step_in_epoch < session.steps_per_epoch
    ):  # epoch ends are checkpointed after eval
        with timer.paused():
            save_checkpoint(session, position)
    if _eval_due(config, position, session):
        with timer.paused():
            _evaluate(session, position, record, progress, timer)
    if timer.split is not None:
        timer.split.mark("other")  # this bookkeeping is the next step's by the timer's clock; not its data


def _slowest(accelerator: Any, seconds: float) -> float:
    """The slowest rank's step time, the same on every rank: each rank decides when its turn ends
    from the step times it sees, and a rank that stopped a step before the others would leave them
    waiting in the next step's collective (an all-gather under FSDP) while it waits for its turn."""
    if accelerator.num_processes == 1:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=accelerator.device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value.item())


def _eval_due(config: TrainConfig, position: Position, session: Session) -> bool:
    """--eval-every: an eval at every N optimizer steps, besides the epoch ends and the last step."""
    return bool(
        config.eval_every
        and position.global_step % config.eval_every == 0
        and position.step_in_epoch < session.steps_per_epoch
        and position.global_step < session.total_steps
    )


def _evaluate(session: Session, position: Position, record: Record, progress: Any, timer: StepTimer) -> None:
    """Eval metrics at this step, with the training wall time so far (`wall_s`: every step's
    duration, warm-up and compilation included, evaluations and checkpoints not)."""
    metrics = evaluate(session.accelerator, session.model, session.eval_dl, session.config.task)
    metrics = {**metrics, "epoch": position.epoch, "step": position.global_step, "wall_s": sum(timer.durations)}
    record.evals.append(metrics)
    session.accelerator.log(
        {f"eval/{k}": v for k, v in metrics.items() if k not in ("epoch", "step", "wall_s")}, step=position.global_step
    )
    shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float) and k != "wall_s")
    progress.say(
        f"epoch {position.epoch + 1}, step {position.global_step}: eval {shown} ({metrics['samples']} samples)"
    )


def _clip_gradients(session: Session, max_norm: float) -> None:
    model = session.model
    if session.config.sharding == "fsdp":
        fsdp.clip_grad_norm_(model, max_norm)  # DTensor gradient shards; no GradScaler (fp16 is refused)
    else:
        session.accelerator.clip_grad_norm_(model.parameters(), max_norm)  # unscales fp16 first


def save_model(session: Session, directory: Path) -> None:
    """The final model (fp32, unwrapped from DDP, autocast and compile; FSDP shards gathered on
    rank 0) with its processor."""
    accelerator = session.accelerator
    accelerator.wait_for_everyone()
    if session.config.sharding == "fsdp":
        model = session.model
        state = fsdp.full_state_dict(model)  # collective: every rank sends its shards, rank 0 keeps them (CPU)
    else:
        model = accelerator.unwrap_model(session.model, keep_fp32_wrapper=False, keep_torch_compile=False)
        state = None  # save_pretrained reads the model's own
    if accelerator.is_main_process:
        model.save_pretrained(directory, state_dict=state, safe_serialization=True)
        session.loaded.processor.save_pretrained(directory)
    accelerator.wait_for_everyone()


def cuda_sync(session: Session) -> Any:
    if uses_cuda(session.config):
        device = session.accelerator.device
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
