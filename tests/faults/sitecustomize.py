"""FAULT INJECTION for tests, never shipped in the package: with this directory on PYTHONPATH and
ACCELAB_TEST_FAULT set, every Python process (the spawned bench and verify children included)
gets the faults it names, comma-separated:

- perturb-weights:<relative size>: seeded Gaussian noise of that relative size is added to the
  floating-point weights of every model accelab loads for a plan, i.e. a deliberately broken
  plan. The fp32 reference the quality guard compares against is left alone; the Result's notes
  say the fault was injected. Used by tests/test_quality_e2e.py and tests/test_bench_e2e.py.
- rmsnorm-scale:<factor>: every RMSNorm weight of a model accelab loads for a plan (torch plans;
  the fp32 reference is left alone) is multiplied by <factor>: a small, systematic fault (1.05 moves
  SmolLM2's next-token distributions by a mean KL of ~0.03) that the teacher-forced quality
  verdict must fail with its interval clear of the line (tests/test_quality_e2e.py).
- serve-errors:<flag file>: while the flag file exists, every forward of the loaded model raises
  (an error burst for a running server; tests/test_monitoring.py).
- slow-serve:<plan>:<ms>: an `accelab serve --plan <plan>` process sleeps <ms> more in every
  continuous-batching step, and twice the step's own time more (at least 3x slower however busy
  the machine): a deliberately slow candidate (tests/test_tune_serve.py).
- ballast-serve:<plan>:<MiB>: an `accelab serve --plan <plan>` process holds <MiB> of touched
  memory: a candidate over a memory limit (tests/test_tune_serve.py).
- fake-gpu:<bytes>: FAKE GPU memory readings for the server's GPU gauges (this machine has no
  GPU): one device reporting <bytes> allocated, twice that reserved, 1.5x peak. Only the metrics
  see it; the model still runs on the CPU (tests/test_monitoring.py).
- train-lr:<row>:<factor>: a training worker whose run directory ends with <row> (a `train --bench`
  or `--tune` row's slug) trains with its learning rate multiplied by <factor>: a plan that
  truly hurts learning (tests/test_train_tune.py).
- slow-train:<row>:<ms>: such a worker sleeps <ms> more in every optimizer step: a candidate that
  is slow on purpose (tests/test_train_tune.py)."""

import os

FAULT = os.environ.get("ACCELAB_TEST_FAULT")
KINDS = (
    "perturb-weights",
    "rmsnorm-scale",
    "serve-errors",
    "fake-gpu",
    "slow-serve",
    "ballast-serve",
    "train-lr",
    "slow-train",
)


def _perturb_weights(size: str) -> None:
    import torch

    import accelab.runtimes as runtimes
    from accelab.quality.verify import REFERENCE_PLAN

    scale = float(size or 0.5)
    original = runtimes.load_runnable

    def faulty_load_runnable(spec, plan, device):
        runnable = original(spec, plan, device)
        if plan.name == REFERENCE_PLAN.name:
            return runnable  # the reference is never the thing under test
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in runnable.model.parameters():
                if param.is_floating_point():
                    noise = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
                    param.add_(noise * param.float().std().nan_to_num(0).to(param.dtype) * scale)
        runnable.notes.append(f"FAULT INJECTED for testing: perturb-weights:{size}")
        return runnable

    runtimes.load_runnable = faulty_load_runnable


def _rmsnorm_scale(factor: str) -> None:
    import torch

    import accelab.runtimes as runtimes
    from accelab.quality.verify import REFERENCE_PLAN

    scale = float(factor or 1.05)
    original = runtimes.load_runnable

    def faulty_load_runnable(spec, plan, device):
        runnable = original(spec, plan, device)
        if plan.name == REFERENCE_PLAN.name:
            return runnable  # the reference is never the thing under test
        norms = [m for m in runnable.model.modules() if type(m).__name__.endswith("RMSNorm")]
        with torch.no_grad():
            for norm in norms:
                norm.weight.mul_(scale)
        runnable.notes.append(f"FAULT INJECTED for testing: rmsnorm-scale:{factor} ({len(norms)} RMSNorm weights)")
        return runnable

    runtimes.load_runnable = faulty_load_runnable


def _serve_errors(flag: str) -> None:
    import accelab.runtimes as runtimes

    if not flag:
        raise ValueError("ACCELAB_TEST_FAULT=serve-errors:<flag file>: name the file that switches the errors on")
    original = runtimes.load_runnable

    def fail_while_flagged(module, args):
        if os.path.exists(flag):
            raise RuntimeError(f"FAULT INJECTED for testing: the model fails while {flag} exists")

    def faulty_load_runnable(spec, plan, device):
        runnable = original(spec, plan, device)
        runnable.model.register_forward_pre_hook(fail_while_flagged)
        return runnable

    runtimes.load_runnable = faulty_load_runnable


class _FakeCuda:
    """Answers like torch.cuda for the memory gauges: one FAKE device."""

    def __init__(self, allocated: int):
        self.allocated = allocated

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def memory_allocated(self, index: int) -> int:
        return self.allocated

    def memory_reserved(self, index: int) -> int:
        return 2 * self.allocated

    def max_memory_allocated(self, index: int) -> int:
        return self.allocated * 3 // 2


def _fake_gpu(allocated: str) -> None:
    import functools

    import accelab.serve.process_gauges as gauges

    gauges.gpu_gauges = functools.partial(gauges.gpu_gauges, cuda=_FakeCuda(int(allocated or 1 << 30)))


def _serving(plan: str) -> bool:
    """Whether this process is `accelab serve ... --plan <plan>`."""
    import sys

    argv = sys.argv
    return "serve" in argv and any(a == "--plan" and b == plan for a, b in zip(argv, argv[1:]))


def _slow_serve(arg: str) -> None:
    plan, _, ms = arg.rpartition(":")
    if not _serving(plan):
        return
    import time

    from accelab.serve.continuous import ContinuousWorker

    original = ContinuousWorker._compute

    def slow_compute(self, chunks):
        # <ms> more, and twice the step's own time more: slower than its rivals on a busy machine
        # too, where a fixed sleep drowns in a neighbour's load (a 3 s window saw 3-4 tokens/s)
        started = time.perf_counter()
        out = original(self, chunks)
        time.sleep(float(ms) / 1000 + 2 * (time.perf_counter() - started))
        return out

    ContinuousWorker._compute = slow_compute


_BALLAST: list[bytearray] = []


def _ballast_serve(arg: str) -> None:
    plan, _, mib = arg.rpartition(":")
    if _serving(plan):
        _BALLAST.append(bytearray(b"\x01") * (int(mib) << 20))  # every page written: resident


def _train_lr(arg: str) -> None:
    row, _, factor = arg.rpartition(":")
    import sys

    if "accelab.train.worker" not in sys.orig_argv:  # python -m accelab.train.worker (torchrun's workers too)
        return
    import accelab.train.optim as optim

    original = optim.optimizer_and_schedule

    def faulty_optimizer(config, model, total):
        if config.output_dir.rstrip("/").endswith(row):
            config = config.with_changes(lr=config.lr * float(factor))
        return original(config, model, total)

    optim.optimizer_and_schedule = faulty_optimizer


def _slow_train(arg: str) -> None:
    row, _, ms = arg.rpartition(":")
    import sys

    if "accelab.train.worker" not in sys.orig_argv:
        return
    import time

    import accelab.train.loop as loop

    original = loop._after_step

    def slow_after_step(session, *args, **kwargs):
        if session.config.output_dir.rstrip("/").endswith(row):
            time.sleep(float(ms) / 1000)  # before the step's clock is read: the step is this much slower
        return original(session, *args, **kwargs)

    loop._after_step = slow_after_step


if FAULT:
    for fault in FAULT.split(","):
        kind, _, arg = fault.partition(":")
        if kind not in KINDS:
            raise ValueError(f"ACCELAB_TEST_FAULT={FAULT!r}: {kind!r} is not one of {', '.join(KINDS)}")
        {
            "perturb-weights": _perturb_weights,
            "rmsnorm-scale": _rmsnorm_scale,
            "serve-errors": _serve_errors,
            "fake-gpu": _fake_gpu,
            "slow-serve": _slow_serve,
            "ballast-serve": _ballast_serve,
            "train-lr": _train_lr,
            "slow-train": _slow_train,
        }[kind](arg)
