"""Result factories shared by the report / history / regress tests.

SYNTHETIC: every Result made here is invented, with only the metric keys its producer writes
(`accelab.results.contract`; checked below). Each carries the note SYNTHETIC_NOTE so that nobody
mistakes one for a measurement. The end-to-end tests (tests/test_report_e2e.py) use real bench
Results and add these only for train / loadtest / tune; tests/test_results_contract.py builds
Results with the producers' own functions.
"""

from __future__ import annotations

import random

from accelab.results import contract as K
from accelab.results.result import Result

SYNTHETIC_NOTE = "SYNTHETIC test data: not a measurement"
ENV = {
    "hostname": "ci-runner-1",
    "platform": "Linux-6.1-x86_64",
    "cpu_model": "Test CPU 9000",
    "physical_cores": 2,
    "logical_cores": 2,
    "available_cores": 2,
    "cpu": {"native_bf16": False, "native_fp16": False, "torch_capability": "AVX2"},
    "ram_total_bytes": 8 * 2**30,
    "gpus": [],
    "driver_version": None,
    "cuda_version": None,
    "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.0.0", "accelerate": "1.15.0"},
    "torch_threads": {"intra_op": 2, "inter_op": 2},
}
FINGERPRINT = "aaaaaaaaaaaa"
OTHER_ENV = {**ENV, "cpu_model": "Other CPU 1", "versions": {**ENV["versions"], "torch": "2.9.0"}}
OTHER_FINGERPRINT = "bbbbbbbbbbbb"


def stats(p50: float, cv: float = 0.02, n: int = 20, tail: float = 0.1) -> dict[str, float]:
    stdev = p50 * cv
    return {
        "n": n,
        "mean": p50 * 1.01,
        "stdev": stdev,
        "cv": cv,
        "min": p50 * 0.95,
        "p50": p50,
        "p90": p50 * (1 + tail / 2),
        "p99": p50 * (1 + tail),
        "max": p50 * (1 + tail * 1.2),
    }


def samples(p50: float, cv: float, n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [max(p50 * 0.5, rng.gauss(p50, p50 * cv)) for _ in range(n)]


def bench(
    *,
    p50: float = 10.0,
    cv: float = 0.02,
    batch: int = 8,
    plan: str = "baseline",
    model: str = "minilm-l6",
    memory: float = 500.0,
    quality: str | None = None,
    tail: float = 0.1,
    n: int = 20,
    kind: str = "bench",
    with_samples: bool = False,
    created: str = "2026-11-01T10:00:00+00:00",
    **kw,
) -> Result:
    """A forward bench Result; throughput = batch / p50, like a steady loop."""
    metrics = {
        "latency_ms": stats(p50, cv, n, tail),
        "throughput": batch / (p50 / 1000),
        "throughput_unit": "items/s",
        "peak_memory_mb": memory,
        "threads": {"intra_op": 2, "inter_op": 2},
        "load_s": 1.0,
        "first_call_s": 0.1,
    }
    if with_samples:
        metrics["latency_samples_ms"] = samples(p50, cv, n)
    q = None if quality is None else {"verdict": quality, "metrics": {"cosine_min": 0.999}, "rules": ["cosine >= 0.99"]}
    base = dict(
        kind=kind,
        status="ok",
        model={"name": model, "task": "feature-extraction"},
        plan={"name": plan, "precision": "fp32", "threads": 2, "batch_size": batch if kind == "tune" else None},
        workload={
            "scenario": "forward",
            "batch_size": batch,
            "seq_len": 128,
            "new_tokens": 32,
            "image_size": None,
            "inputs": "real",
            "warmup": 2,
            "min_iters": 5,
            "min_seconds": 3.0,
        },
        metrics=metrics,
        quality=q,
        environment=ENV,
        fingerprint=FINGERPRINT,
        notes=[SYNTHETIC_NOTE],
        command=f"accelab bench {model} -b {batch} --plan {plan}",
        created=created,
    )
    base.update(kw)
    return Result(**base)


def train(
    plan: str = "baseline", *, epochs: int = 3, steps_per_epoch: int = 20, speed: float = 1.0, decay: float = 0.97, **kw
) -> Result:
    """SYNTHETIC `accelab train` Result, in the shape accelab.train.report stores: per-step losses,
    evals per epoch (0-based epoch, optimizer step), epoch_s, step_ms stats, peak RSS."""
    rng = random.Random(plan)
    steps = epochs * steps_per_epoch
    losses = [2.3 * (decay**s) + 0.1 + rng.uniform(-0.04, 0.04) for s in range(1, steps + 1)]
    evals = [
        {
            "accuracy": 0.9 - 0.3 * decay ** ((e + 1) * steps_per_epoch),
            "loss": 2.3 * decay ** ((e + 1) * 20),
            "samples": 360,
            "epoch": e,
            "step": (e + 1) * steps_per_epoch,
        }
        for e in range(epochs)
    ]
    step_ms = stats(320.0 / speed, cv=0.03)
    return Result(
        kind="train",
        status="ok",
        model={"name": "vit-tiny", "task": "image-classification"},
        plan={"name": plan, "precision": "bf16-autocast" if plan == "bf16" else "fp32", "batch_size": 32},
        workload={
            "scenario": "train-step",
            "task": "image-classification",
            "dataset": "digits",
            "global_batch": 32,
            "grad_accum": 1,
            "nproc": 1,
            "nnodes": 1,
            "epochs": epochs,
        },
        metrics={
            "samples_per_s": 100.0 * speed,
            "epoch_s": 12.0 / speed,
            "epoch_s_estimated": False,
            "step_ms": step_ms,
            "steps": steps,
            "peak_rss_mb_max": 900.0,
            "losses": losses,
            "final_loss": losses[-1],
            "evals": evals,
            "final_accuracy": evals[-1]["accuracy"],
        },
        environment=ENV,
        fingerprint=FINGERPRINT,
        notes=[SYNTHETIC_NOTE],
        **kw,
    )


def loadtest(**kw) -> Result:
    """SYNTHETIC `accelab loadtest --find-max` Result, in the shape accelab.loadtest.run stores:
    probes (rate, percentiles, served and good requests/s), max_rate, the SLO in workload (s)."""
    probes = []
    for rate in (1, 2, 4, 8, 16, 12, 10):  # doubling, then bisection, like the search
        knee = max(0.0, rate - 10) ** 2
        e2e = stats(40 + 2 * rate + knee * 3, tail=0.3 + knee / 20)
        served = min(rate, 11.0)
        good = served * (1.0 if e2e["p99"] <= 120 else 0.6)
        probes.append(
            {
                "rate": rate,
                "passed": good / rate >= 0.95,
                "goodput_fraction": good / rate,
                "goodput_rate": good,
                "request_throughput": served,
                "output_token_throughput": served * 32,
                "errors_by_status": {},
                "e2e_ms": {q: e2e[q] for q in ("p50", "p90", "p99")},
                "ttft_ms": None,
            }
        )
    best = stats(60.0, tail=0.5)
    return Result(
        kind="loadtest",
        status="ok",
        model={"name": "smollm2-135m", "task": "text-generation", "server": "http://127.0.0.1:8000"},
        plan={"name": "baseline"},
        workload={
            "scenario": "loadtest",
            "endpoint": "chat",
            "mode": "open",
            "rate": 1.0,
            "slo": {"e2e": 0.12},
            "find_max": True,
            "goodput_target": 0.95,
        },
        metrics={"e2e_ms": best, "request_throughput": 10.0, "offered_rate": 10.0, "max_rate": 10.0, "probes": probes},
        notes=[SYNTHETIC_NOTE],
        **kw,
    )


def tune_group(group: str = "tune01") -> list[Result]:
    """SYNTHETIC tune trials: one group over plans and batch sizes, so that throughput trades
    against p99 latency and memory. Front on latency: b1, compile b4, bf16 b8, int8 b16, int8 b32."""
    trials = [
        ("baseline", 1, 4.0, 300),
        ("baseline", 8, 20.0, 500),
        ("bf16", 8, 14.0, 420),
        ("compile", 4, 8.0, 520),
        ("int8-dynamic", 16, 18.0, 380),
        ("int8-dynamic", 32, 30.0, 640),
        ("slow", 8, 30.0, 700),
    ]
    results = []
    for i, (name, batch, p50, mem) in enumerate(trials):
        r = bench(
            kind="tune",
            plan=name,
            batch=batch,
            p50=p50,
            memory=mem,
            group_id=group,
            model="vit-tiny",
            created=f"2026-11-02T10:00:{i:02d}+00:00",
        )
        r.metrics.update(tune_candidate=f"{name}@{batch}", tune_phase="final", tune_seq=i + 1)
        results.append(r)
    # a short screening run of one candidate, measured before its final run: the final one counts
    screen = bench(
        kind="tune",
        plan="baseline",
        batch=8,
        p50=40.0,
        memory=500,
        group_id=group,
        model="vit-tiny",
        created="2026-11-02T09:59:00+00:00",
    )
    screen.metrics.update(tune_candidate="baseline@8", tune_phase="screen", tune_seq=0)
    return [screen, *results]


def test_factories_are_labelled_synthetic():
    for r in [bench(), train(), loadtest(), *tune_group()]:
        assert SYNTHETIC_NOTE in r.notes


def test_factories_write_only_what_the_producers_write():
    assert K.FORWARD.unnamed(bench(with_samples=True).metrics) == []
    assert all(K.TUNE_FORWARD.unnamed(r.metrics) == [] for r in tune_group())
    t = train()
    assert K.TRAIN.unnamed(t.metrics) == [] and all(K.EVAL.unnamed(e) == [] for e in t.metrics[K.EVALS])
    lt = loadtest()
    assert K.FIND_MAX.unnamed(lt.metrics) == [] and all(K.PROBE.unnamed(p) == [] for p in lt.metrics[K.PROBES])
