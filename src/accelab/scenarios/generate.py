"""The generate scenario: greedy decoding of exactly `new_tokens` tokens per sequence.

TTFT is the time to the first new token (prefill + one sampling step), TPOT the mean time per
later token, ITL the distribution of gaps between tokens. A fresh `TokenClock` is made for every
call, so the bookkeeping never carries over between calls. Its metric keys are
`accelab.results.contract.GENERATE`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from accelab.measure.stats import capped_samples, summarize
from accelab.plan.runtime import Runnable
from accelab.results import contract as K
from accelab.scenarios.timing import synchronizer
from accelab.scenarios.workload import Workload


class TokenClock(StoppingCriteria):
    """Records the time each decoding step produced its tokens; never stops generation.

    transformers calls stopping criteria once per step, right after the step's tokens are
    appended, so the first timestamp marks the first token.
    """

    def __init__(self, sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter):
        self.sync = sync
        self.clock = clock
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.sync()  # note: a CPU-GPU sync point per token, so the timestamp is the token's
        self.times.append(self.clock())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate_once(runnable: Runnable, batch: dict[str, torch.Tensor], new_tokens: int) -> tuple[Any, float, list[float]]:
    """One timed generate call: (output ids, start time, per-token timestamps)."""
    sync = synchronizer(runnable.device)
    token_clock = TokenClock(sync)
    sync()
    start = time.perf_counter()
    output = runnable.generate(
        batch,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([token_clock]),
    )
    sync()
    end = time.perf_counter()
    return output, start, token_clock.times or [end]


def run_generate(runnable: Runnable, batch: dict[str, torch.Tensor], workload: Workload) -> dict[str, Any]:
    n, batch_size = workload.new_tokens, workload.batch_size
    first_calls: list[float] = []
    output = None
    for _ in range(max(workload.warmup, 1)):  # the first call is always excluded: it may compile
        output, start, stamps = generate_once(runnable, batch, n)
        first_calls.append(stamps[-1] - start)

    ttft, tpot, itl, e2e = [], [], [], []
    loop_start = time.perf_counter()
    while True:
        output, start, stamps = generate_once(runnable, batch, n)
        ttft.append(stamps[0] - start)
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        itl.extend(gaps)
        if gaps:
            tpot.append(sum(gaps) / len(gaps))
        e2e.append(stamps[-1] - start)
        elapsed = time.perf_counter() - loop_start
        if (len(e2e) >= workload.min_iters and elapsed >= workload.min_seconds) or elapsed >= workload.max_seconds:
            break
    wall = time.perf_counter() - loop_start

    prompt_len = batch["input_ids"].shape[1]
    produced = output[:, prompt_len:] if torch.is_tensor(output) else None
    tokens_per_call = batch_size * n
    decode_seconds = sum(t * (n - 1) for t in tpot)
    metrics: dict[str, Any] = {
        K.TTFT_MS: summarize([t * 1000 for t in ttft]).to_dict(),
        K.E2E_MS: summarize([t * 1000 for t in e2e]).to_dict(),
        K.LATENCY_SAMPLES_MS: capped_samples([t * 1000 for t in e2e]),
        K.ITERATIONS: len(e2e),
        K.TIMED_SECONDS: wall,
        K.NEW_TOKENS: n,
        K.PROMPT_TOKENS: int(prompt_len),
        K.ITEMS_PER_CALL: batch_size,
        # tokens of all sequences over the wall time of the timed loop (prefill included)
        K.THROUGHPUT: tokens_per_call * len(e2e) / wall,
        K.THROUGHPUT_UNIT: K.GENERATE.key(K.THROUGHPUT).unit,
        K.REQUESTS_PER_S: batch_size * len(e2e) / wall,
        K.FIRST_CALL_S: first_calls[0],
        K.FIRST_CALL_OVERHEAD_S: max(first_calls[0] - sum(e2e) / len(e2e), 0.0),
    }
    if tpot:
        metrics[K.TPOT_MS] = summarize([t * 1000 for t in tpot]).to_dict()
        metrics[K.ITL_MS] = summarize([t * 1000 for t in itl]).to_dict()
        # decode-only rate: tokens after the first, over the time spent producing them
        metrics[K.DECODE_TOKENS_PER_S] = batch_size * (n - 1) * len(tpot) / decode_seconds
        metrics[K.DECODE_STEP_S] = sum(tpot) / len(tpot)
    if produced is not None and produced.shape[1] != n:
        raise RuntimeError(f"generate produced {produced.shape[1]} tokens, asked for exactly {n}")
    metrics[K.GENERATED_TOKENS_CHECKED] = produced is not None
    metrics[K.SAMPLE_TEXT] = _decode_first(runnable, produced)
    return metrics


def _decode_first(runnable: Runnable, produced: torch.Tensor | None) -> str | None:
    if produced is None:
        return None
    tokenizer = getattr(runnable.processor, "tokenizer", runnable.processor)
    if not hasattr(tokenizer, "decode"):
        return None
    return tokenizer.decode(produced[0], skip_special_tokens=True)
