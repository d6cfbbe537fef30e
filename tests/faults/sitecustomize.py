"""FAULT INJECTION for tests, never shipped in the package: with this directory on PYTHONPATH and
ACCELAB_TEST_FAULT=perturb-weights:<relative size>, every Python process (the spawned bench and
verify children included) adds seeded Gaussian noise of that relative size to the floating-point
weights of every model accelab loads for a plan, i.e. a deliberately broken plan. The fp32
reference the quality guard compares against is left alone; the Result's notes say the fault
was injected. Used by tests/test_quality_e2e.py and tests/test_bench_e2e.py."""

import os

FAULT = os.environ.get("ACCELAB_TEST_FAULT")

if FAULT:
    import torch

    import accelab.runtimes as runtimes
    from accelab.quality.verify import REFERENCE_PLAN

    kind, _, size = FAULT.partition(":")
    if kind != "perturb-weights":
        raise ValueError(f"ACCELAB_TEST_FAULT={FAULT!r}: the only fault is perturb-weights:<relative size>")
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
        runnable.notes.append(f"FAULT INJECTED for testing: {FAULT}")
        return runnable

    runtimes.load_runnable = faulty_load_runnable
