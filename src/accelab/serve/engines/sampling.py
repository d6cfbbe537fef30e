"""Picking each sequence's next token from its logits, with its own sampling parameters and
random generator (the continuous engines; a static batch samples inside `generate`).

Greedy rows take the argmax. Sampled rows divide by their temperature, keep the smallest set
of tokens holding `top_p` of the probability, and draw with their own `torch.Generator`, so a
request with a seed gets the same tokens whatever else shares its steps.
"""

from __future__ import annotations

import torch

from accelab.serve.engines.base import SamplingParams


class Generators:
    """One torch.Generator per sampled sequence, seeded from its request (or at random)."""

    def __init__(self) -> None:
        self._by_seq: dict[int, torch.Generator] = {}

    def get(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        generator = self._by_seq.get(seq_id)
        if generator is None:
            generator = torch.Generator()
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
            self._by_seq[seq_id] = generator
        return generator

    def release(self, seq_id: int) -> None:
        self._by_seq.pop(seq_id, None)


def pick_tokens(logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int],
                generators: Generators) -> list[int]:
    """logits: [N, V] (one row per sequence that samples now) -> N token ids."""
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, seq_id) in enumerate(zip(params, seq_ids)):
        if not p.greedy:
            tokens[row] = _sample(logits[row].float(), p, generators.get(seq_id, p))
    return tokens


def _sample(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """scores: [V] float32."""
    probs = torch.softmax(scores / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
