"""The sampling contract every engine calls (`runner.sampling.sample`): each row's own rules
inside one batch of logits, exact numbers on small hand-made logits."""

from __future__ import annotations

import math

import torch

from accelab.serve.engines.base import SamplingParams, StepInput
from accelab.serve.runner.logprobs import describe, prompt_logprobs
from accelab.serve.runner.sampling import SequenceSampler, sample, sample_step

EOS = 3


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 8), **kw)


def sampler(**kw) -> SequenceSampler:
    prompt = kw.pop("prompt", ())
    return SequenceSampler(params(**kw), prompt=prompt, eos_ids=(EOS,))


def rows(*values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def picks(s: SequenceSampler, logits: list[float], times: int = 1) -> list[int]:
    return [sample(rows(logits), [s])[0].token for _ in range(times)]


def test_greedy_rows_take_the_argmax_beside_sampled_ones():
    out = sample(rows([0.0, 5.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0]), [sampler(temperature=0), sampler(seed=1)])
    assert out[0].token == 1 and out[0].logprob is None


def test_a_seed_repeats_the_draws_whatever_else_runs_beside_and_choices_differ():
    def draws(neighbours: int, offset: int = 0) -> list[int]:
        mine = SequenceSampler(params(seed=1234), seed_offset=offset)
        others = [sampler() for _ in range(neighbours)]
        return [sample(torch.zeros(1 + neighbours, 50), [mine, *others])[0].token for _ in range(20)]

    alone, crowded = draws(0), draws(3)
    assert alone == crowded and len(set(alone)) > 5
    assert draws(0, offset=1) != alone  # choice 1 of n draws from seed + 1


def test_top_p_top_k_and_min_p_keep_only_their_tokens():
    logits = torch.log(torch.tensor([0.64, 0.24, 0.09, 0.03])).tolist()
    assert set(picks(sampler(top_p=0.7, seed=0), logits, 200)) == {0, 1}
    assert set(picks(sampler(top_k=3, seed=0), logits, 300)) == {0, 1, 2}
    assert set(picks(sampler(min_p=0.3, seed=0), logits, 200)) == {0, 1}  # 0.09 < 0.3 x 0.64
    assert len(set(picks(sampler(seed=0), logits, 300))) == 4  # none of them: every token comes


def test_logit_bias_forces_and_bans_tokens():
    assert picks(sampler(temperature=0, logit_bias=((2, 100.0),)), [5.0, 1.0, 0.0, 0.0]) == [2]
    assert picks(sampler(temperature=0, logit_bias=((0, -100.0),)), [5.0, 1.0, 0.0, 0.0]) == [1]


def test_penalties_move_the_argmax_away_from_seen_tokens():
    logits = [2.0, 1.9, 1.0, -5.0]
    rep = sampler(temperature=0, repetition_penalty=1.2, prompt=(0,))  # 2.0 / 1.2 < 1.9
    assert picks(rep, logits) == [1]
    presence = sampler(temperature=0, presence_penalty=0.5)
    assert picks(presence, logits, 3) == [0, 1, 0]  # each taken token pays 0.5 once
    frequency = sampler(temperature=0, frequency_penalty=0.4)
    assert picks(frequency, logits, 7) == [0, 1, 0, 1, 0, 1, 2]  # 0.4 per occurrence: 2.0-1.2, 1.9-1.2 < 1.0
    assert frequency.counts == {0: 3, 1: 3, 2: 1}


def test_min_tokens_and_ignore_eos_ban_the_end_and_stop_tokens():
    logits = [0.0, 1.0, 2.0, 9.0]  # EOS (3) is the argmax
    early = SequenceSampler(params(temperature=0, min_tokens=2, stop_token_ids=(2,)), eos_ids=(EOS,))
    assert picks(early, logits, 3) == [1, 1, 3]  # neither EOS nor the stop token before 2 tokens
    never = sampler(temperature=0, ignore_eos=True)
    assert picks(never, logits, 3) == [2, 2, 2]


class FakeGrammar:
    """A FAKE matcher (test only): allows the tokens of a fixed sequence, one after another."""

    def __init__(self, sequence: list[int]):
        self.sequence, self.taken = sequence, []

    def allowed(self, vocab: int) -> torch.Tensor:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[self.sequence[len(self.taken)] if len(self.taken) < len(self.sequence) else EOS] = True
        return mask

    def consume_token(self, token: int) -> None:
        self.taken.append(token)


def test_a_grammar_mask_decides_even_against_the_logits_and_the_bans():
    grammar = FakeGrammar([2, 0])
    s = SequenceSampler(params(temperature=0, ignore_eos=True), eos_ids=(EOS,), grammar=grammar)
    assert picks(s, [0.0, 9.0, 1.0, 5.0], 3) == [2, 0, EOS]  # EOS banned, but the grammar allows only it
    assert grammar.taken == [2, 0, EOS]
    sampled = SequenceSampler(params(seed=3), grammar=FakeGrammar([1]))
    assert picks(sampled, [9.0, 0.0, 0.0, 0.0]) == [1]


def test_logprobs_are_log_softmax_of_the_raw_logits_with_the_top_alternatives():
    logits = rows([1.0, 3.0, 2.0, 0.5], [0.0, 0.0, 0.0, 4.0])
    out = sample(logits, [sampler(temperature=0, logprobs=2, logit_bias=((0, 50.0),)), sampler(seed=1, logprobs=0)])
    expected = torch.log_softmax(logits, dim=-1)
    assert out[0].token == 0  # the bias chose it; its logprob is the model's own
    assert math.isclose(out[0].logprob, float(expected[0, 0]), abs_tol=1e-6)
    assert [t for t, _ in out[0].top] == [1, 2]
    assert math.isclose(out[0].top[0][1], float(expected[0, 1]), abs_tol=1e-6)
    assert out[1].top == () and math.isclose(out[1].logprob, float(expected[1, out[1].token]), abs_tol=1e-6)


def test_prompt_logprobs_and_their_text():
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    tokens = [5, 1, 4, 2]
    out = prompt_logprobs(logits, tokens, top=1)
    expected = torch.log_softmax(logits, dim=-1)
    assert out[0].token == 5 and out[0].logprob is None
    for i in range(1, 4):
        assert math.isclose(out[i].logprob, float(expected[i - 1, tokens[i]]), abs_tol=1e-6)
        assert out[i].top[0][0] == int(expected[i - 1].argmax())
    text = describe(out, lambda ids: f"<{ids[0]}>")
    assert text[0].token == "<5>" and text[0].logprob is None and text[2].top[0][0] == f"<{out[2].top[0][0]}>"


def test_sample_step_without_a_sampler_uses_the_inputs_params():
    item = StepInput(seq_id=0, start=0, tokens=(1,), sample=True, params=params(temperature=0))
    assert sample_step(rows([0.0, 1.0, 7.0, 2.0]), [item])[0].token == 2


def test_rows_with_the_common_rules_sampled_together_draw_what_each_draws_alone():
    """The batched path (temperature, top_k, top_p, min_p as one [n, V] tensor) against each
    row's own `pick` with an identically seeded generator: the same tokens, draw after draw."""
    rules = [
        dict(temperature=0.7, seed=1),
        dict(top_k=5, seed=2),
        dict(top_p=0.8, temperature=1.3, seed=3),
        dict(min_p=0.05, top_k=40, seed=4),
        dict(top_p=0.5, min_p=0.1, seed=5),
    ]
    together = [sampler(**r) for r in rules]
    alone = [sampler(**r) for r in rules]
    assert all(s.simple for s in together)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        logits = torch.randn(len(rules), 100, generator=g) * 3
        batched = [t.token for t in sample(logits, together)]
        assert batched == [s.pick(s.scores(logits[i])) for i, s in enumerate(alone)]
        for s, token in zip(alone, batched):
            s.accept(token)
    assert sum(len(s.counts) for s in together) > 5 * 5  # they did draw, not argmax


def test_a_row_with_other_rules_beside_the_batched_ones_keeps_them():
    """A row with a logit bias or logprobs goes its own way; the others are batched around it."""
    biased = sampler(temperature=0.5, seed=1, logit_bias=((7, 100.0),))
    logged = sampler(seed=2, logprobs=2)
    plain = [sampler(seed=s) for s in (3, 4)]
    out = sample(torch.zeros(4, 10), [plain[0], biased, logged, plain[1]])
    assert out[1].token == 7 and out[2].logprob is not None and len(out[2].top) == 2
    assert out[0].logprob is None and out[3].logprob is None
    assert not biased.simple and not logged.simple and plain[0].simple


def test_tiny_and_non_finite_values_still_pick_a_token():
    """A tiny top_p keeps the most likely token; a temperature below 1e-5 is greedy; +inf scores
    (a tiny repetition penalty dividing a positive logit) are the only candidates; NaN never wins."""
    logits = [0.5, 2.0, 1.0, 0.0]
    assert set(picks(sampler(top_p=5e-324, seed=0), logits, 20)) == {1}
    assert sampler(temperature=1e-300).params.greedy and picks(sampler(temperature=1e-300), logits) == [1]
    assert set(picks(sampler(repetition_penalty=5e-324, prompt=(0, 2), seed=0), logits, 30)) <= {0, 2}
    assert picks(sampler(temperature=0), [float("nan"), 1.0, float("nan"), 0.0]) == [1]
    mixed = [sampler(top_p=5e-324, seed=1), sampler(temperature=0.5, seed=2)]
    assert sample(rows([float("nan"), 3.0, 1.0, 0.0], [0.0, 0.0, float("inf"), 0.0]), mixed)[1].token == 2


class FixedGrammar:
    """A FAKE matcher (test only): the same allowed tokens at every step, no tensor work."""

    def __init__(self, allowed: torch.Tensor):
        self.mask = allowed

    def allowed(self, vocab: int) -> torch.Tensor:
        return self.mask

    def consume_token(self, token: int) -> None:
        pass


def every_kind(vocab: int) -> list[SequenceSampler]:
    """One sampler of each kind a batch may mix: greedy, sampled, biased, penalised, banned,
    grammar-masked (one whose bans leave nothing), with log-probabilities."""
    return [
        sampler(temperature=0),
        sampler(seed=1, top_k=20, top_p=0.9, min_p=0.02),
        sampler(temperature=0, logit_bias=((7, 4.0), (EOS, -3.0))),
        sampler(seed=2, temperature=0.7, logit_bias=((11, 2.5), (11, 0.5), (vocab + 5, 9.0))),
        sampler(temperature=0, repetition_penalty=1.5, prompt=(1, 2, 5, 5, 9)),
        sampler(seed=3, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=0.9, prompt=(4,)),
        SequenceSampler(params(temperature=0, min_tokens=6, stop_token_ids=(2,), max_tokens=30), eos_ids=(EOS,)),
        sampler(seed=4, ignore_eos=True, top_p=0.5),
        SequenceSampler(params(temperature=0), eos_ids=(EOS,), grammar=FakeGrammar([5, 9, 5, 12, 0])),
        SequenceSampler(params(seed=5, ignore_eos=True), eos_ids=(EOS,), grammar=FakeGrammar([8])),  # then EOS only
        sampler(temperature=0, logprobs=3, frequency_penalty=0.5),
        sampler(seed=6, logprobs=0, logit_bias=((0, 1.0),)),
        sampler(seed=7, logprobs=20, top_k=5, min_tokens=3, max_tokens=30),
    ]


def test_a_mixed_batch_picks_for_each_row_what_it_picks_alone():
    """Every kind of row in one batch, step after step, against twins that pick alone: the same
    tokens (greedy rows and seeded draws), the same log-probabilities and alternatives."""
    vocab = 64
    together, alone = every_kind(vocab), every_kind(vocab)
    g = torch.Generator().manual_seed(0)
    for step in range(24):
        logits = torch.randn(len(together), vocab, generator=g) * 3
        logits[:, EOS] += 4.0  # the end is often the argmax: the bans must hold
        batched = sample(logits, together)
        for i, (s, mine) in enumerate(zip(alone, batched)):
            own = sample(logits[i : i + 1], [s])[0]
            assert mine.token == own.token, (step, i)
            assert (mine.logprob is None) == (own.logprob is None) and [t for t, _ in mine.top] == [
                t for t, _ in own.top
            ]
            if own.logprob is not None:
                assert mine.logprob is not None and math.isclose(mine.logprob, own.logprob, abs_tol=1e-6)
                assert all(math.isclose(a, b, abs_tol=1e-6) for (_, a), (_, b) in zip(mine.top, own.top))
    tokens = [s.output.tolist() for s in together]
    assert tokens == [s.output.tolist() for s in alone]
    assert EOS not in tokens[6][:6] and 2 not in tokens[6][:6] and EOS not in tokens[7]  # the bans held
    assert tokens[8][:5] == [5, 9, 5, 12, 0] and tokens[9][:2] == [8, EOS]  # the grammar decided
    assert len(batched[12].top) == 20 and batched[11].top == () and batched[0].logprob is None
    assert len(set(tokens[1])) > 5  # the sampled rows did draw


def test_the_batched_path_has_no_per_row_work_over_the_vocabulary():
    """Counted at torch's dispatcher: the operations that read or write a vocabulary-sized
    tensor. Twelve more rows, every one with every rule, add only the sampled rows' draws (one
    torch.multinomial each, with the row's own generator), not a per-row pass of the rules."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = 4096

    class VocabOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in (*args, *(kwargs or {}).values(), out) if isinstance(t, torch.Tensor)]
            self.count += any(t.numel() >= vocab for t in tensors)
            return out

    def ops(rows: int) -> int:
        allowed = torch.rand(vocab, generator=torch.Generator().manual_seed(0)) < 0.5
        batch = [
            SequenceSampler(
                params(
                    seed=i if i % 2 else None,
                    temperature=0.8 if i % 2 else 0.0,
                    top_k=40,
                    top_p=0.9,
                    min_p=0.01,
                    logit_bias=((i, 2.0),),
                    min_tokens=4,
                    repetition_penalty=1.2,
                    presence_penalty=0.3,
                    frequency_penalty=0.2,
                    logprobs=2,
                ),
                prompt=tuple(range(i, 600, 7)),
                eos_ids=(EOS,),
                grammar=FixedGrammar(allowed),
            )
            for i in range(rows)
        ]
        for s in batch:
            s.accept(5)
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
        with VocabOps() as counter:
            sample(logits, batch)
        return counter.count

    small, large = ops(4), ops(16)
    assert large - small == (16 - 4) // 2, (small, large)  # the 6 more sampled rows' draws
