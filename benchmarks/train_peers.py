"""accelab train against Hugging Face Trainer and a plain accelerate loop: the same model, data,
global batch, LR schedule, optimizer (AdamW, accelab's weight-decay groups), precision and threads.

Contenders, each a fresh process per run (accelerate's state is per process):
- `accelab train` (the CLI, `--no-save --no-progress --json`) at the same plan as the peers;
- `transformers.Trainer` at that recipe and its defaults otherwise (fused AdamW, its own loop);
- accelerate's README loop (Accelerator, prepare, backward, step), with the same clipping;
- Trainer at its documented CPU settings (`torch_compile`, and `bf16` where the CPU has native
  bf16), beside accelab at the same settings (`--compile`, `--mixed-precision bf16`).
All build the model and data with accelab's functions and draw accelab's (seed, epoch) data
order (`benchmarks/train_peers_run.py`), so their first losses agree: printed for every run.

Each process trains a fixed number of optimizer steps, timed inside it by accelab's StepTimer
(each step from the end of the previous one, data loading included; the first `--warmup` steps
left out of samples/s). Rounds run the contenders A B C ... then ... C B A; the CPU steal and
the other processes' CPU of each run's window come from /proc/stat (`accelab.measure.noise`).
Reported per model: samples/s per round, the median, the quietest round, and each peer's rate
over accelab's at the same plan, paired round by round.

Time to target (`--tuned-plan FILE`, written by `accelab train --tune ... --out FILE`): Trainer at
its defaults and `accelab train --plan FILE` train `--target-epochs` epochs, evaluating every
`--eval-samples` samples; reported: the training wall time (evaluations excluded) until each
reaches `--target-accuracy` (default: Trainer's final accuracy).

    python benchmarks/train_peers.py                      # both models, 4 rounds: ~30 min on 2 quiet cores
    python benchmarks/train_peers.py --only accelab,trainer,accelerate           # no compiling: ~8 min
    python benchmarks/train_peers.py --model vit-tiny --rounds 1 --steps 8 --only accelab,trainer,accelerate
    python benchmarks/train_peers.py --rounds 0 --tuned-plan train.yaml           # time to target alone
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import train_peers_report as R
from machine import cpu_line, cpu_record
from train_peers_run import Precision, RunSpec, spec_json

from accelab.measure.noise import Meter
from accelab.train.config import TrainConfig
from accelab.train.options import DEFAULTS, FROM_SCRATCH

Kind = Literal["accelab", "trainer", "accelerate"]  # accelab: the CLI; the others: train_peers_run.py
RESULTS = Path(__file__).parent / "results"
RUNNER = Path(__file__).with_name("train_peers_run.py")
RUN_TIMEOUT_S = 1800.0
WARMUP_RATIO = TrainConfig.__dataclass_fields__["warmup_ratio"].default  # accelab's default share of warm-up steps


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelCase:
    """A model of the benchmark: its image side and its default steps."""

    image_size: int  # the default; `--image-size` changes it where the model's side is not fixed
    fixed_size: bool  # ViT: position embeddings sized for its config's image_size
    steps: int
    reinit_head: bool  # its head has another label count than digits' 10


MODELS = {
    "vit-tiny": ModelCase(image_size=32, fixed_size=True, steps=40, reinit_head=False),  # 10 labels already
    "resnet-50": ModelCase(image_size=64, fixed_size=False, steps=24, reinit_head=True),  # 1000 ImageNet labels
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Contender:
    key: str
    label: str
    kind: Kind
    precision: Precision
    compile: bool
    versus: str  # the accelab contender at the same plan


def contenders(precision: Precision, native_bf16: bool) -> dict[str, Contender]:
    """The same-plan trio, and Trainer's documented CPU settings beside accelab at those settings."""
    docs_precision: Precision = "bf16" if native_bf16 else precision
    docs = "torch_compile" + (", bf16" if docs_precision == "bf16" else "")
    flags = "--compile" + (" --mixed-precision bf16" if docs_precision == "bf16" else "")

    def same(key: str, label: str, kind: Kind) -> Contender:
        return Contender(key=key, label=label, kind=kind, precision=precision, compile=False, versus="accelab")

    def tuned(key: str, label: str, kind: Kind) -> Contender:
        return Contender(key=key, label=label, kind=kind, precision=docs_precision, compile=True, versus="accelab-docs")

    rows = [
        same("accelab", f"accelab train ({precision})", "accelab"),
        same("trainer", f"HF Trainer, defaults ({precision})", "trainer"),
        same("accelerate", f"accelerate README loop ({precision})", "accelerate"),
        tuned("accelab-docs", f"accelab train {flags}", "accelab"),
        tuned("trainer-docs", f"HF Trainer, CPU docs' settings ({docs})", "trainer"),
    ]
    return {c.key: c for c in rows}


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): where the CPU docs' bf16 applies."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def base_spec(model: str, opts: argparse.Namespace) -> RunSpec:
    from accelab.catalog.resolve import resolve

    case = MODELS[model]
    steps = opts.steps or case.steps
    return RunSpec(
        kind="trainer",
        model=model,
        model_source=resolve(model).source,
        image_size=case.image_size if case.fixed_size or opts.image_size is None else opts.image_size,
        reinit_head=case.reinit_head,
        batch_size=opts.batch_size,
        lr=FROM_SCRATCH["lr"],
        weight_decay=DEFAULTS["image-classification"]["weight_decay"],
        warmup_steps=max(1, round(WARMUP_RATIO * steps)),
        max_steps=steps,
        seed=opts.seed,
        precision=opts.precision,
        threads=opts.threads,
        timing_warmup=min(opts.warmup, steps - 1),
    )


# -- one run -------------------------------------------------------------------------------------
def accelab_command(spec: RunSpec, out: Path, output_dir: Path, plan: str | None = None) -> list[str]:
    """`accelab train` at the spec's recipe; with `plan`, the plan's settings and accelab's defaults
    (time to target: only the length and the eval spacing are given)."""
    cmd = [sys.executable, "-m", "accelab", "train", "--model", spec.model, "--dataset", "digits", "--seed"]
    cmd += [str(spec.seed)]
    cmd += ["--image-size", str(spec.image_size)] if spec.image_size else []
    cmd += ["--reinit-head"] if spec.reinit_head else []
    if plan is not None:
        cmd += ["--plan", plan, "--epochs", str(spec.epochs), "--eval-every", str(spec.eval_every)]
    else:
        cmd += ["--batch-size", str(spec.batch_size), "--lr", str(spec.lr), "--weight-decay", str(spec.weight_decay)]
        cmd += ["--schedule", "cosine", "--warmup-steps", str(spec.warmup_steps), "--max-steps", str(spec.max_steps)]
        cmd += ["--max-grad-norm", str(spec.max_grad_norm), "--threads", str(spec.threads)]
        cmd += ["--mixed-precision", "bf16" if spec.precision == "bf16" else "no"]
        cmd += ["--compile" if spec.compile else "--no-compile", "--bench-warmup", str(spec.timing_warmup)]
    cmd += ["--no-save", "--no-progress", "--no-store", "--json", str(out), "--output-dir", str(output_dir)]
    return cmd


def run_once(kind: Kind, spec: RunSpec, tmp: Path, name: str, plan: str | None = None) -> dict[str, Any]:
    """One contender's process, with the machine's noise over its window; the figures it reports."""
    out, spec_path = tmp / f"{name}.out.json", tmp / f"{name}.spec.json"
    if kind == "accelab":
        cmd = accelab_command(spec, out, tmp / f"{name}.run", plan)
    else:
        spec_path.write_text(spec_json(dataclasses.replace(spec, kind=kind)))  # kind: trainer | accelerate
        cmd = [sys.executable, str(RUNNER), str(spec_path), str(out)]
    # a cold compile cache for every run: inductor's on-disk cache would otherwise hand the run
    # after the first the compiled kernels of the same graphs (its warm-up, and a time to target)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"{name}.inductor")}
    started = time.monotonic()
    with Meter() as meter:  # this process's reaped children count as its own CPU: the rest is others'
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, check=False)
    row: dict[str, Any] = {"process_s": time.monotonic() - started, "command": shlex.join(cmd)}
    if meter.window is not None:  # None off Linux
        row.update(steal=meter.window.steal, others_cores=meter.window.others_cores, level=meter.window.level)
    if done.returncode != 0 or not out.is_file():
        return {**row, "error": f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"}
    found = json.loads(out.read_text())
    return {**row, **(from_accelab(found) if kind == "accelab" else from_peer(found))}


def from_accelab(result: dict[str, Any]) -> dict[str, Any]:
    if result.get("status") != "ok":
        return {"error": f"accelab train: {result.get('status')}: {result.get('reason')}"}
    m = result["metrics"]
    return {
        "samples_per_s": m["samples_per_s"],
        "timed_wall_s": m["timed_wall_s"],
        "timed_steps": m["timed_steps"],
        "warmup_s": m["warmup_s"],
        "losses": m["losses"],
        "evals": m["evals"],
        "threads": m["threads_per_process"],
        "plan": result.get("plan"),
    }


def from_peer(found: dict[str, Any]) -> dict[str, Any]:
    timing = found["timing"]
    return {
        "samples_per_s": timing["samples_per_s"],
        "timed_wall_s": timing["timed_wall_s"],
        "timed_steps": timing["timed_steps"],
        "warmup_s": timing["warmup_s"],
        "losses": found["losses"],
        "evals": found["evals"],
        "threads": found["threads"],
        "step_s": found["durations"],
    }


# -- the rounds ----------------------------------------------------------------------------------
def rotation(keys: list[str], rounds: int) -> list[list[str]]:
    """A B C, then C B A, ...: every contender as often early in a round as late."""
    return [list(keys) if r % 2 == 0 else list(reversed(keys)) for r in range(rounds)]


def measure(model: str, chosen: dict[str, Contender], opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    base = base_spec(model, opts)
    rows: dict[str, list[dict[str, Any]]] = {key: [] for key in chosen}
    for r, order in enumerate(rotation(list(chosen), opts.rounds)):
        for key in order:
            c = chosen[key]
            spec = dataclasses.replace(base, precision=c.precision, compile=c.compile)
            row = {"round": r, **run_once(c.kind, spec, tmp, f"{model}-{key}-{r}")}
            rows[key].append(row)
            print(f"  {model} round {r + 1} {c.label:<58} {R.run_line(row)}", flush=True)
    return {
        "spec": dataclasses.asdict(base),
        "contenders": {k: dataclasses.asdict(c) for k, c in chosen.items()},
        "rows": rows,
    }


# -- time to target ------------------------------------------------------------------------------
def time_to_target(opts: argparse.Namespace, tmp: Path) -> dict[str, Any] | None:
    from accelab.train import plan_file

    if not opts.tuned_plan:
        return None
    plan = plan_file.read(opts.tuned_plan) if plan_file.is_train_plan(opts.tuned_plan) else None
    model = (plan.model if plan and plan.model else None) or opts.target_model
    if model not in MODELS:
        raise SystemExit(f"the tuned plan is for {model}; this benchmark trains {', '.join(MODELS)}")
    batch = int((plan.train if plan else {}).get("batch_size", opts.batch_size))
    trainer_spec = dataclasses.replace(
        base_spec(model, opts),
        precision="fp32",
        max_steps=None,
        epochs=opts.target_epochs,
        eval_every=max(1, round(opts.eval_samples / opts.batch_size)),
        warmup_steps=None,  # accelab's default share of all steps, as the plan's run gets
        timing_warmup=0,
    )
    print(f"time to target: {model}, HF Trainer at its defaults, {opts.target_epochs} epoch(s)", flush=True)
    trainer = run_once("trainer", trainer_spec, tmp, f"ttt-{model}-trainer")
    trainer.update(precision="fp32", compile=False, batch_size=trainer_spec.batch_size)
    accelab_spec = dataclasses.replace(trainer_spec, eval_every=max(1, round(opts.eval_samples / batch)))
    print(f"time to target: {model}, accelab train --plan {opts.tuned_plan}", flush=True)
    accelab = run_once("accelab", accelab_spec, tmp, f"ttt-{model}-accelab", plan=opts.tuned_plan)
    return R.target_summary(model, trainer, accelab, opts.target_accuracy, plan.name if plan else opts.tuned_plan)


# -- main ----------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), action="append", help="repeat for several (default: both)")
    p.add_argument("--rounds", type=int, default=4, help="rounds (each contender once per round); 0: none")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run (default 40 vit-tiny, 24 resnet-50)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of samples/s (compilation)")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["image-classification"]["batch_size"])
    p.add_argument("--image-size", type=int, default=None, help="resnet-50's image side (default 64; ViT's is fixed)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="the same-plan contenders'")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="intra-op threads, all runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="contenders, comma-separated: " + ",".join(contenders("fp32", False)))
    p.add_argument("--tuned-plan", default="", help="a plan from `accelab train --tune --out FILE`: time to target")
    p.add_argument("--target-model", choices=sorted(MODELS), default="vit-tiny", help="when the plan names none")
    p.add_argument("--target-epochs", type=int, default=10, help="epochs of both time-to-target runs")
    p.add_argument("--target-accuracy", type=float, default=None, help="default: Trainer's final accuracy")
    p.add_argument("--eval-samples", type=int, default=320, help="time to target: evaluate every this many samples")
    p.add_argument("--out", type=Path, default=RESULTS / "train_peers.txt")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    models = opts.model or list(MODELS)
    every = contenders(opts.precision, native_bf16())
    keys = opts.only.split(",") if opts.only else list(every)
    unknown = [k for k in keys if k not in every]
    if unknown or "accelab" not in keys:
        raise SystemExit(f"--only {opts.only}: choose from {', '.join(every)}, accelab among them")
    chosen = {k: every[k] for k in keys}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="train_peers-") as tmp:
        found = {model: measure(model, chosen, opts, Path(tmp)) for model in models} if opts.rounds else {}
        target = time_to_target(opts, Path(tmp))
    # the CPU line here, not in R.report: that module is pure (no I/O)
    text = cpu_line() + "\n" + R.report(found, target, opts, argv if argv is not None else sys.argv[1:])
    text += f"\ntook {(time.monotonic() - started) / 60:.1f} min"
    print("\n" + text)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(text + "\n")
    payload = {
        "cpu": cpu_record(),
        "models": found,
        "time_to_target": target,
        "threads": opts.threads,
        "rounds": opts.rounds,
    }
    opts.out.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
