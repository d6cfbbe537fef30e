"""One peer contender of `benchmarks/train_peers.py`, in a fresh interpreter of its own:
Hugging Face `Trainer`, or the plain accelerate loop of accelerate's README.

    python benchmarks/train_peers_run.py SPEC.json OUT.json

Both build the model and the data with accelab's own functions (`load_for_training`: the
catalog model, fp32, its head fitted to digits' 10 labels after `set_seed(seed)`;
`accelab.train.data.build`: the catalog's digits train / test split through the model's image
processor), so only the training loop differs from `accelab train`. The data order is
accelab's (seed, epoch) permutation (`EpochSampler`) for all three, so the first losses agree.

Timing is accelab's `StepTimer`: each optimizer step lasts from the end of the previous one to
its own end (data loading included); evaluation is paused out; the first `timing_warmup` steps
are left out of samples/s. Trainer is timed by a callback (on_step_end, restarted on_evaluate).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

Kind = Literal["trainer", "accelerate"]
Precision = Literal["fp32", "bf16"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """What one peer process trains; the same recipe `accelab train` gets on its command line."""

    kind: Kind
    model: str  # catalog name
    model_source: str  # its local directory
    image_size: int | None  # None: the model's own (ViT's config.image_size)
    reinit_head: bool
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int | None  # None: accelab's default share of all steps (`warmup_for`)
    max_steps: int | None  # None: `epochs` epochs (time to target)
    epochs: int = 1
    eval_every: int | None = None  # time to target: also evaluate every N steps (else at epoch ends)
    seed: int = 0
    precision: Precision = "fp32"
    compile: bool = False
    threads: int
    timing_warmup: int
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("trainer", "accelerate"):
            raise ValueError(f"kind={self.kind!r} is not allowed; choose trainer or accelerate")
        if self.kind == "accelerate" and (self.max_steps is None or self.compile):
            raise ValueError("the plain accelerate loop runs a fixed number of eager steps: set max_steps, no compile")


# -- what all peers share with accelab ---------------------------------------------------------
def accelab_config(spec: RunSpec, output_dir: str) -> Any:
    """accelab's TrainConfig of the same recipe: its model and data builders read it."""
    from accelab.train.config import TrainConfig

    return TrainConfig(
        model=spec.model,
        model_source=spec.model_source,
        image_size=spec.image_size,
        reinit_head=spec.reinit_head,
        batch_size=spec.batch_size,
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        warmup_steps=spec.warmup_steps,
        max_steps=spec.max_steps,
        epochs=spec.epochs,
        seed=spec.seed,
        mixed_precision="bf16" if spec.precision == "bf16" else "no",
        threads=spec.threads,
        timing_warmup=spec.timing_warmup,
        output_dir=output_dir,
    )


def model_and_data(config: Any) -> tuple[Any, Any]:
    """accelab's model (seeded as accelab seeds it) and digits data."""
    from accelerate.utils import set_seed

    from accelab.train.data import build, class_names
    from accelab.train.model import load_for_training

    set_seed(config.seed)
    loaded = load_for_training(config, class_names(config))
    return loaded.model, build(config, loaded.processor, loaded.image_size)


def sampler_for(config: Any, size: int) -> Any:
    from accelab.train.sampler import EpochSampler

    return EpochSampler(size, seed=config.seed, multiple_of=config.batch_size)


def decay_names(model: torch.nn.Module, weight_decay: float) -> list[str]:
    """Names of the parameters in accelab's weight-decay group (`accelab.train.optim.param_groups`)."""
    from accelab.train.optim import param_groups

    decayed = {id(p) for p in param_groups(model, weight_decay)[0]["params"]}
    return [name for name, p in model.named_parameters() if id(p) in decayed]


# -- Hugging Face Trainer ----------------------------------------------------------------------
def trainer_args(spec: RunSpec, output_dir: str, warmup_steps: int) -> Any:
    """TrainingArguments of the recipe; Trainer's defaults otherwise (its fused AdamW included).
    No eval, save or logging while timed (time to target evaluates, paused out of the clock);
    no progress bar (accelab runs with --no-progress too)."""
    from transformers import TrainingArguments

    if spec.max_steps is not None:
        length: dict[str, Any] = {"max_steps": spec.max_steps, "eval_strategy": "no"}
    elif spec.eval_every:
        length = {"num_train_epochs": spec.epochs, "eval_strategy": "steps", "eval_steps": spec.eval_every}
    else:
        length = {"num_train_epochs": spec.epochs, "eval_strategy": "epoch"}
    return TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=spec.batch_size,
        per_device_eval_batch_size=spec.batch_size,
        learning_rate=spec.lr,
        weight_decay=spec.weight_decay,
        lr_scheduler_type="cosine",
        warmup_steps=warmup_steps,
        max_grad_norm=spec.max_grad_norm,
        seed=spec.seed,
        bf16=spec.precision == "bf16",
        torch_compile=spec.compile,
        dataloader_num_workers=0,
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **length,
    )


def run_trainer(spec: RunSpec, output_dir: str) -> dict[str, Any]:
    import numpy as np
    from transformers import Trainer, TrainerCallback

    from accelab.train.config import total_steps, warmup_for
    from accelab.train.timing import StepTimer

    config = accelab_config(spec, output_dir)
    model, data = model_and_data(config)
    steps_per_epoch = len(sampler_for(config, len(data.train))) // spec.batch_size
    args = trainer_args(spec, output_dir, warmup_for(config, total_steps(config, steps_per_epoch)))
    timer = StepTimer(warmup=spec.timing_warmup)
    losses: list[torch.Tensor] = []
    evals: list[dict[str, Any]] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            timer.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timer.step_done(int(state.epoch or 0))

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            metrics = kwargs["metrics"]
            evals.append(
                {
                    "step": state.global_step,
                    "wall_s": sum(timer.durations),  # as accelab's evals: training time so far, evals excluded
                    "loss": metrics["eval_loss"],
                    "accuracy": metrics["eval_accuracy"],
                    "samples": len(data.eval),
                }
            )
            timer.start()  # the evaluation counts toward no step

    class SameRecipeTrainer(Trainer):
        """Trainer with accelab's data order and weight-decay groups; it records each step's loss."""

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return sampler_for(config, len(data.train))  # the one training set of this run

        def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
            return decay_names(model, spec.weight_decay)

        def compute_loss(self, model: Any, *a: Any, **kw: Any) -> Any:
            loss = super().compute_loss(model, *a, **kw)
            if model.training:  # not the eval loop's calls
                losses.append((loss[0] if isinstance(loss, tuple) else loss).detach())  # no sync: kept as tensors
            return loss

    def accuracy(prediction: Any) -> dict[str, float]:
        return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}

    trainer = SameRecipeTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        compute_metrics=accuracy,
        callbacks=[Clock()],
    )
    trainer.train()
    return _report(spec, timer, [float(v) for v in losses], evals, steps_per_epoch)


# -- the plain accelerate loop -----------------------------------------------------------------
def run_accelerate(spec: RunSpec, output_dir: str) -> dict[str, Any]:
    """accelerate's README loop (Accelerator, prepare, backward, step), with the recipe's
    clipping and LR schedule, timed per step."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    from accelab.train.config import warmup_for
    from accelab.train.optim import param_groups
    from accelab.train.timing import StepTimer

    assert spec.max_steps is not None
    config = accelab_config(spec, output_dir)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if spec.precision == "bf16" else "no")
    model, data = model_and_data(config)
    optimizer = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr)
    scheduler = get_scheduler(
        "cosine", optimizer, num_warmup_steps=warmup_for(config, spec.max_steps), num_training_steps=spec.max_steps
    )
    sampler = sampler_for(config, len(data.train))
    loader = DataLoader(data.train, batch_size=spec.batch_size, sampler=sampler, drop_last=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    timer = StepTimer(warmup=spec.timing_warmup)
    losses: list[torch.Tensor] = []
    timer.start()
    while len(losses) < spec.max_steps:  # as many epochs as the steps take
        sampler.set_epoch(len(losses) // len(loader))
        for batch in loader:
            optimizer.zero_grad()
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(loss.detach())
            timer.step_done(0)
            if len(losses) == spec.max_steps:
                break
    return _report(spec, timer, [float(v) for v in losses], [], len(loader))


def _report(
    spec: RunSpec, timer: Any, losses: list[float], evals: list[dict[str, Any]], steps_per_epoch: int
) -> dict[str, Any]:
    return {
        "kind": spec.kind,
        "timing": timer.summary(spec.batch_size, steps_per_epoch, []),
        "durations": timer.durations,
        "losses": losses,
        "evals": evals,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python benchmarks/train_peers_run.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = RunSpec(**json.loads(Path(argv[0]).read_text()))
    torch.set_num_threads(spec.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="train-peers-") as output_dir:
        run = run_trainer if spec.kind == "trainer" else run_accelerate
        report = run(spec, output_dir)
    report["process_s"] = time.perf_counter() - started
    Path(argv[1]).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def spec_json(spec: RunSpec) -> str:
    return json.dumps(dataclasses.asdict(spec))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
