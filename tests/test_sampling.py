"""Per-sequence token picking of the continuous engines: greedy rows, temperature, top_p and
a seed that repeats a request whatever shares its steps."""

from __future__ import annotations

import torch

from accelab.serve.engines.base import SamplingParams
from accelab.serve.engines.sampling import Generators, pick_tokens


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_rows_take_the_argmax_beside_sampled_ones():
    gens = Generators()
    scores = logits([0.0, 5.0, 1.0], [3.0, 0.0, 0.0])
    params = [SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=1, temperature=1.0, seed=1)]
    assert pick_tokens(scores, params, [0, 1], gens)[0] == 1


def test_a_seed_repeats_the_draws_whatever_else_runs_beside():
    seeded = SamplingParams(max_tokens=1, temperature=1.0, seed=1234)
    other = SamplingParams(max_tokens=1, temperature=1.0)
    flat = torch.zeros(1, 50)  # uniform: every draw is the generator's choice

    def draws(neighbours: int) -> list[int]:
        gens = Generators()
        out = []
        for _ in range(20):
            rows = torch.zeros(1 + neighbours, 50)
            out.append(pick_tokens(rows, [seeded] + [other] * neighbours, list(range(1 + neighbours)), gens)[0])
        return out

    alone, crowded = draws(0), draws(3)
    assert alone == crowded and len(set(alone)) > 5
    gens = Generators()
    unseeded = [pick_tokens(flat, [other], [9], gens)[0] for _ in range(20)]
    assert unseeded != alone


def test_top_p_keeps_only_the_smallest_set_holding_that_mass():
    gens = Generators()
    # probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.7 keeps the first two
    scores = torch.log(torch.tensor([[0.64, 0.24, 0.09, 0.03]]))
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7, seed=s) for s in range(200)]
    picked = {pick_tokens(scores, [p], [i], gens)[0] for i, p in enumerate(params)}
    assert picked == {0, 1}


def test_low_temperature_sharpens_toward_the_argmax():
    gens = Generators()
    scores = logits([1.0, 1.2, 0.8])
    cold = [pick_tokens(scores, [SamplingParams(max_tokens=1, temperature=0.01, seed=s)], [s], gens)[0]
            for s in range(50)]
    assert set(cold) == {1}
    # a released sequence's generator is gone: the same id and seed start the same draws again
    seeded = SamplingParams(max_tokens=1, temperature=1.0, seed=5)
    flat = torch.zeros(1, 50)
    first = [pick_tokens(flat, [seeded], [99], gens)[0] for _ in range(10)]
    gens.release(99)
    assert [pick_tokens(flat, [seeded], [99], gens)[0] for _ in range(10)] == first
