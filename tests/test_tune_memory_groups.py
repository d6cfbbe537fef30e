"""The serving tune never starts more candidate servers than the machine's memory holds at once
(accelab.tuner.serve_memory): the candidates go out in groups that fit, the baseline's first, and
one that cannot fit even beside the baseline is left out with its figure."""

from __future__ import annotations

import pytest

from accelab.catalog.fetch import is_fetched
from accelab.catalog.resolve import resolve
from accelab.plan import fit
from accelab.plan.plan import load_plan
from accelab.tuner.serve_memory import ENGINE_OVERHEAD, fitting_groups, memory_groups, need_bytes
from accelab.tuner.serve_rank import Candidate

GB = 10**9


def test_candidates_go_out_in_groups_that_fit_the_baseline_first():
    needs = {"baseline": 6 * GB, "a": 4 * GB, "b": 4 * GB, "c": 9 * GB, "d": 3 * GB}
    groups = memory_groups(["baseline", "a", "b", "c", "d"], needs, "baseline", 15 * GB)
    # baseline + a + b (14 GB); c (9) would pass 15: a second group, with d
    assert groups.groups == [["baseline", "a", "b"], ["c", "d"]]
    assert groups.left_out == {}
    assert all(sum(needs[k] for k in g) <= 15 * GB for g in groups.groups)
    assert "one after the other within 15.0 GB available: baseline 6.0 GB + a 4.0 GB + b 4.0 GB; then c 9.0 GB" in (
        groups.describe()
    )


def test_a_candidate_that_cannot_fit_beside_the_baseline_is_left_out_with_its_figure():
    needs = {"baseline": 6 * GB, "big": 10 * GB, "small": 2 * GB, "unknown": None}
    groups = memory_groups(["baseline", "big", "small", "unknown"], needs, "baseline", 13 * GB)
    assert groups.groups == [["baseline", "small"], ["unknown"]]  # unknown: counted as the baseline's 6 GB
    assert groups.left_out["big"].startswith("does not fit this machine's memory beside the baseline: about 10.0 GB")
    assert "the baseline's 6.0 GB, 13.0 GB available" in groups.left_out["big"]


def test_everything_that_fits_runs_at_once():
    groups = memory_groups(["baseline", "a", "b"], {"baseline": GB, "a": GB, "b": GB}, "baseline", 24 * GB)
    assert groups.groups == [["baseline", "a", "b"]] and not groups.left_out


@pytest.mark.skipif(not is_fetched("smollm2-135m"), reason="run `accelab models fetch smollm2-135m` first")
def test_a_candidates_need_is_its_plans_weights_and_overhead_or_its_measured_peak(monkeypatch):
    spec = resolve("smollm2-135m")
    plans = {key: load_plan(key) for key in ("baseline", "int8-weight", "llamacpp[llama_quant=q8_0]")}
    base = need_bytes(spec, plans["baseline"])
    weights = fit.weight_bytes(spec, plans["baseline"])
    assert base == weights + fit.OVERHEAD_FIXED + int(fit.OVERHEAD_SHARE * weights)
    assert need_bytes(spec, plans["int8-weight"]) < base  # a byte a body weight
    engine = plans["llamacpp[llama_quant=q8_0]"]
    assert need_bytes(spec, engine) == fit.weight_bytes(spec, engine) + ENGINE_OVERHEAD
    assert need_bytes(spec, plans["baseline"], peak_mb=900.0) == 900 << 20  # measured before: that
    # the machine made small (a stand-in for an 8B's): baseline and int8 fit at once, bf16 only beside
    # the baseline alone: it waits for a second group
    bf16 = need_bytes(spec, load_plan("bf16"))
    assert need_bytes(spec, plans["int8-weight"]) < bf16
    monkeypatch.setenv(fit.AVAILABLE_ENV, f"{(base + bf16) // 2**20 + 1}MiB")
    candidates = [Candidate(key=key, plan=load_plan(key)) for key in ("baseline", "int8-weight", "bf16")]
    batches, groups = fitting_groups(candidates, spec)
    assert [[c.key for c in batch] for batch in batches] == [["baseline", "int8-weight"], ["bf16"]]
    assert not groups.left_out


@pytest.mark.skipif(not is_fetched("smollm2-135m"), reason="run `accelab models fetch smollm2-135m` first")
def test_a_candidate_whose_server_alone_cannot_fit_is_not_measured_with_the_figures(monkeypatch):
    from accelab.tuner import serving

    spec = resolve("smollm2-135m")
    base, int8 = need_bytes(spec, load_plan("baseline")), need_bytes(spec, load_plan("int8-weight"))
    monkeypatch.setenv(fit.AVAILABLE_ENV, f"{(base + int8) // 2 // 2**20}MiB")  # int8 alone fits, fp32 not
    request = serving.ServeTuneRequest(spec=spec, model="smollm2-135m", include=("baseline", "int8-weight"))
    chosen, pruned = serving.serve_space(request)
    assert [c.key for c in chosen] == ["int8-weight"]
    assert "does not fit this machine's memory: weights 0.5 GB (float32)" in pruned["baseline"]


@pytest.mark.skipif(not is_fetched("smollm2-135m"), reason="run `accelab models fetch smollm2-135m` first")
def test_compares_reference_is_the_widest_precision_that_fits_and_it_says_so(monkeypatch):
    import torch

    from accelab.benchmark.commands import reference_that_fits

    spec = resolve("smollm2-135m")
    plans = [load_plan(key) for key in ("baseline", "int8-weight")]
    said: list[str] = []
    assert reference_that_fits(spec, plans, torch.device("cpu"), say=said.append) == plans and not said
    # float32 does not fit, bf16 does (0.3 GB of weights against 0.5): bf16 becomes the reference
    fp32, bf16 = (fit.footprint(spec, load_plan(key)).total for key in ("baseline", "bf16"))
    monkeypatch.setenv(fit.AVAILABLE_ENV, f"{(fp32 + bf16) // 2 // 2**20}MiB")
    swapped = reference_that_fits(spec, plans, torch.device("cpu"), say=said.append)
    assert [p.name for p in swapped] == ["bf16", "int8-weight"]
    assert said[0].startswith("reference: bf16 in place of baseline, the widest precision that fits:")
    assert "weights 0.5 GB (float32)" in said[0]
