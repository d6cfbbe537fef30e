"""The written contract of `Result.metrics`: every key each producer writes, with its unit and
meaning. Producers write these names (the constants below); `accelab.report` reads exactly these
and guesses no synonyms; tests/test_results_contract.py fails when a producer writes a key its
contract does not name.

A latency distribution ("stats" below) is `accelab.measure.stats.Stats.to_dict()`: n, mean, stdev,
cv, min, p50, p90, p99, max, in ms. Memory is MiB (2**20 bytes), named `_mb` as the store has it.

| producer                                       | Result.kind              | contract              |
|------------------------------------------------|--------------------------|-----------------------|
| scenarios/forward.py + benchmark/child.py      | bench, compare, tune     | FORWARD (+ TUNE)      |
| scenarios/generate.py + benchmark/child.py     | bench, compare, tune     | GENERATE (+ TUNE)     |
| loadtest/summary.py + loadtest/run.py          | loadtest                 | LOADTEST, FIND_MAX    |
| train/report.py (train/timing.py, loop.py)     | train                    | TRAIN                 |
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    unit: str  # "ms", "s", "MiB", "items/s", ...; "" for counts, flags, labels and nested records
    meaning: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Contract:
    producer: str  # the module(s) that write these keys
    keys: tuple[Key, ...]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(k.name for k in self.keys)

    def key(self, name: str) -> Key:
        return next(k for k in self.keys if k.name == name)

    def unnamed(self, written: Mapping[str, Any] | Iterable[str]) -> list[str]:
        """The keys of `written` this contract does not name (a producer drifted from it)."""
        return sorted(set(written) - self.names)

    def extended(self, producer: str, *keys: Key) -> Contract:
        return Contract(producer=producer, keys=(*self.keys, *keys))


def keys(table: str) -> tuple[Key, ...]:
    """A table, one key a line: name, unit ("-": none), meaning, columns apart by two spaces or more;
    an indented line goes on with the meaning of the key above it."""
    rows: list[list[str]] = []
    for line in table.strip("\n").splitlines():
        if line[:1].isspace():
            rows[-1][2] += " " + line.strip()
        elif line:
            rows.append(re.split(r"\s{2,}", line.strip(), maxsplit=2))
    return tuple(Key(name, "" if unit == "-" else unit, meaning) for name, unit, meaning in rows)


# -- key names ----------------------------------------------------------------------------------
# the timed loop of a bench scenario (forward and generate)
LATENCY_MS: Final = "latency_ms"
LATENCY_SAMPLES_MS: Final = "latency_samples_ms"
ITERATIONS: Final = "iterations"
TIMED_SECONDS: Final = "timed_seconds"
ITEMS_PER_CALL: Final = "items_per_call"
THROUGHPUT: Final = "throughput"
THROUGHPUT_UNIT: Final = "throughput_unit"
FIRST_CALL_S: Final = "first_call_s"
FIRST_CALL_OVERHEAD_S: Final = "first_call_overhead_s"
# generation (bench generate; the loadtest's per-request figures share the names)
TTFT_MS: Final = "ttft_ms"
TPOT_MS: Final = "tpot_ms"
ITL_MS: Final = "itl_ms"
E2E_MS: Final = "e2e_ms"
NEW_TOKENS: Final = "new_tokens"
PROMPT_TOKENS: Final = "prompt_tokens"
REQUESTS_PER_S: Final = "requests_per_s"
DECODE_TOKENS_PER_S: Final = "decode_tokens_per_s"
DECODE_STEP_S: Final = "decode_step_s"
GENERATED_TOKENS_CHECKED: Final = "generated_tokens_checked"
SAMPLE_TEXT: Final = "sample_text"
# what benchmark/child.py and benchmark/rounds.py add around a scenario
LOAD_S: Final = "load_s"
MEMORY: Final = "memory"
PEAK_RSS_MB: Final = "peak_rss_mb"
PEAK_MEMORY_MB: Final = "peak_memory_mb"
THREADS: Final = "threads"
DEVICE: Final = "device"
PLACEMENT: Final = "placement"
HARDWARE: Final = "hardware"
WEIGHT_BYTES: Final = "weight_bytes"
FLOPS_PER_CALL: Final = "flops_per_call"
ACHIEVED_FLOPS: Final = "achieved_flops"
MFU: Final = "mfu"
MFU_UNKNOWN: Final = "mfu_unknown"
ROOFLINE: Final = "roofline"
ROOFLINE_UNKNOWN: Final = "roofline_unknown"
NOISE: Final = "noise"
ROUNDS: Final = "rounds"
SPEEDUP: Final = "speedup"
TRACEBACK: Final = "traceback"  # any kind: the child's traceback, the only key of a crashed run
# the tuner's bookkeeping on its bench Results
TUNE_CANDIDATE: Final = "tune_candidate"
TUNE_PHASE: Final = "tune_phase"
TUNE_SEQ: Final = "tune_seq"
TUNE_COST_S: Final = "tune_cost_s"
TUNE_QUALITY: Final = "tune_quality"
# a load test run
REQUESTS: Final = "requests"
OK_REQUESTS: Final = "ok"
ERRORS: Final = "errors"
ERRORS_BY_STATUS: Final = "errors_by_status"
DURATION_S: Final = "duration_s"
OFFERED_RATE: Final = "offered_rate"
REQUEST_THROUGHPUT: Final = "request_throughput"
OUTPUT_TOKEN_THROUGHPUT: Final = "output_token_throughput"
OUTPUT_TOKENS: Final = "output_tokens"
SLO: Final = "slo"
GOODPUT_FRACTION: Final = "goodput_fraction"
GOODPUT_RATE: Final = "goodput_rate"
GOOD_REQUESTS: Final = "good_requests"
# a window of a serving tune
GOODPUT_TOKEN_THROUGHPUT: Final = "goodput_token_throughput"
TUNE_ROUND: Final = "tune_round"
MAX_RATE: Final = "max_rate"
SEARCH: Final = "search"
PROBES: Final = "probes"
RATE: Final = "rate"
PASSED: Final = "passed"
CONCURRENCY: Final = "concurrency"
ENDPOINT: Final = "endpoint"
# a training run
SAMPLES_PER_S: Final = "samples_per_s"
EPOCH_S: Final = "epoch_s"
EPOCH_S_ESTIMATED: Final = "epoch_s_estimated"
STEP_MS: Final = "step_ms"
TIMED_STEPS: Final = "timed_steps"
TIMED_SAMPLES: Final = "timed_samples"
TIMED_WALL_S: Final = "timed_wall_s"
WARMUP_S: Final = "warmup_s"
STEP_SPLIT: Final = "step_split"
STEPS: Final = "steps"
STEPS_PER_EPOCH: Final = "steps_per_epoch"
PEAK_RSS_MB_MAX: Final = "peak_rss_mb_max"
PEAK_RSS_MB_SUM: Final = "peak_rss_mb_sum"
PEAK_RSS_MB_PER_RANK: Final = "peak_rss_mb_per_rank"
GPU_PEAK_ALLOCATED_MB_MAX: Final = "gpu_peak_allocated_mb_max"
STATE_MB_PER_RANK: Final = "state_mb_per_rank"
STATE_MB_MAX: Final = "state_mb_max"
SKIPPED_STEPS: Final = "skipped_steps"
FIRST_LOSS: Final = "first_loss"
FINAL_LOSS: Final = "final_loss"
LOSSES: Final = "losses"
EVALS: Final = "evals"
FINAL_ACCURACY: Final = "final_accuracy"
FINAL_PERPLEXITY: Final = "final_perplexity"
THREADS_PER_PROCESS: Final = "threads_per_process"
WALL_S: Final = "wall_s"
# one evaluation of a training run (an item of `evals`)
ACCURACY: Final = "accuracy"
PERPLEXITY: Final = "perplexity"
LOSS: Final = "loss"
SAMPLES: Final = "samples"
TOKENS: Final = "tokens"
EPOCH: Final = "epoch"
STEP: Final = "step"

# -- bench: forward and generate ------------------------------------------------------------------
_TIMED_LOOP = keys("""
latency_samples_ms     ms  every timed call's latency, sorted, at most 2000 (evenly subsampled)
iterations             -   timed calls
timed_seconds          s   wall time of the timed loop
items_per_call         -   the batch size of each call
throughput_unit        -   the unit of `throughput`: items/s (forward) or tokens/s (generate)
first_call_s           s   the first (warm-up) call, compilation and lazy init included
first_call_overhead_s  s   what the first call took beyond a steady one
""")
_ENGINE = keys("""
load_s          s      loading the model and applying the plan
memory          MiB    the memory sampler's report (accelab.measure.memory.MemoryReport)
peak_rss_mb     MiB    the child process's maximum resident set size (getrusage)
peak_memory_mb  MiB    THE peak: torch's peak GPU allocation on CUDA, else the sampled peak RSS
threads         -      torch threads: {intra_op, inter_op}
device          -      the device the plan ran on, e.g. cpu, cuda:0
placement       -      where a device map put the modules (device-map and offload plans only)
hardware        -      {peak_flops, compute_path, bandwidth_bytes_per_s} the figures are against
weight_bytes    bytes  the model's weights
noise           -      what the machine did besides the run (accelab.measure.noise.summary): level quiet | noisy |
                       unreliable, reason, steal, steal_max, others_cores, others_cores_max, throttled, load1, cv,
                       rounds, rounds_used
rounds          -      every timed round (accelab.benchmark.rounds.rounds_record): rate, seconds, calls, cv, used,
                       steal, others_cores, throttled, level
speedup         -      compare rows after the reference: the paired ratio over the reference's rounds
                       (accelab.measure.paired.Ratio): value, low, high, rounds, dropped, verdict, reason, confidence,
                       reference
""")
FORWARD: Final = Contract(
    producer="accelab.scenarios.forward.ForwardScenario"
    " + accelab.benchmark.child.BenchChild + accelab.benchmark.rounds",
    keys=(
        *keys("""
latency_ms      ms        stats of one forward call (the request latency)
throughput      items/s   items of all timed calls / wall time of the timed loop
flops_per_call  FLOP      FLOPs of one forward (FlopCounterMode); unquantised plans only
achieved_flops  FLOP/s    flops_per_call / p50 latency
mfu             fraction  achieved FLOP/s over the measured peak of the plan's compute path, 0..1
mfu_unknown     -         why the MFU is not reported (it measured above 100% twice)
"""),
        *_TIMED_LOOP,
        *_ENGINE,
    ),
)
GENERATE: Final = Contract(
    producer="accelab.scenarios.generate.GenerateScenario"
    " + accelab.benchmark.child.BenchChild + accelab.benchmark.rounds",
    keys=(
        *keys("""
e2e_ms                    ms           stats of one generate call of exactly new_tokens tokens (the request latency)
ttft_ms                   ms           stats of the time to the first new token (prefill + one sampling step)
tpot_ms                   ms           stats of the mean time per later token, one value per call
itl_ms                    ms           stats of the gaps between tokens
throughput                tokens/s     new tokens of all sequences / wall time of the timed loop, prefill included
new_tokens                -            tokens generated per sequence
prompt_tokens             -            tokens of the (padded) prompt per sequence
requests_per_s            sequences/s  sequences completed / wall time of the timed loop
decode_tokens_per_s       tokens/s     tokens after the first / the time spent producing them
decode_step_s             s            mean time of one decoding step
generated_tokens_checked  -            whether the output's length was checked to be exactly new_tokens
sample_text               -            the first sequence's new text, decoded (None without a tokenizer)
roofline                  -            {fraction, achieved_bandwidth, ...}: weight bytes per decoding step over
                                       bandwidth
roofline_unknown          -            why the roofline is not reported (it measured above 100% twice)
"""),
        *_TIMED_LOOP,
        *_ENGINE,
    ),
)
_TUNE = keys("""
tune_candidate  -  the candidate measured: '<preset>@<batch>'
tune_phase      -  screen | grow | final (accelab.tuner.search.Phase); later phases measure longer
tune_seq        -  the measurement's place in the tune, 0-based
tune_cost_s     s  wall time the measurement cost, child start included
tune_quality    -  the verdict label of the candidate's technique: pass | warn | fail | cannot tell (...) | None
""")
TUNE_FORWARD: Final = FORWARD.extended("accelab.tuner.measure.BenchMeasurer on a forward workload", *_TUNE)
TUNE_GENERATE: Final = GENERATE.extended("accelab.tuner.measure.BenchMeasurer on a generate workload", *_TUNE)

# -- loadtest -------------------------------------------------------------------------------------
LOADTEST: Final = Contract(
    producer="accelab.loadtest.summary.summarize_run (one run at one load)",
    keys=keys("""
e2e_ms                   ms        stats of the request latency, send to last byte, successful requests (None: none)
ttft_ms                  ms        stats of the time to the first content chunk, streamed requests (None: none)
tpot_ms                  ms        stats of the mean time per output token after the first (None: none)
itl_ms                   ms        stats of the inter-token gaps, spread over the tokens of each chunk (None: none)
requests                 -         requests sent (after warm-up)
ok                       -         requests answered with 200
errors                   -         requests that failed
errors_by_status         -         {status or error:<Exception>: count}
duration_s               s         first send to last answer
offered_rate             req/s     the open-loop rate sent (None: closed loop, see workload.concurrency)
request_throughput       req/s     successful requests / duration_s
output_token_throughput  tokens/s  output tokens of successful requests / duration_s
output_tokens            -         output tokens of successful requests
prompt_tokens            -         prompt tokens of successful requests
slo                      s         the objectives, {ttft, tpot, e2e}: seconds
goodput_fraction         fraction  requests that succeeded and met every objective / requests
goodput_rate             req/s     requests that succeeded and met every objective / duration_s
good_requests            -         requests that succeeded and met every objective
"""),
)
PROBE: Final = Contract(
    producer="accelab.loadtest.run (one item of `probes`: latencies with p50, p90, p99 only)",
    keys=(
        *keys("""
rate    req/s  the rate this probe offered
passed  -      whether its goodput met the target
"""),
        *(
            LOADTEST.key(name)
            for name in (
                E2E_MS,
                TTFT_MS,
                GOODPUT_FRACTION,
                GOODPUT_RATE,
                REQUEST_THROUGHPUT,
                OUTPUT_TOKEN_THROUGHPUT,
                ERRORS_BY_STATUS,
            )
        ),
    ),
)
FIND_MAX: Final = LOADTEST.extended(
    "accelab.loadtest.run.build_result with a find-max search (the best probe's run, and the search)",
    *keys("""
max_rate  req/s  the highest rate that met the goodput target (None: none did)
search    -      accelab.loadtest.findmax.FindMax.to_dict(): best_rate, lowest_failing, probes
probes    -      every probe in search order, each with the PROBE keys
"""),
)
TUNE_SERVE: Final = LOADTEST.extended(
    "accelab.tuner.serve_window.measure_window and window_result (one window of a serving tune, kind tune-serve)",
    *keys("""
goodput_token_throughput  tokens/s  output tokens of the requests that met every objective / duration_s
noise                     -         accelab.measure.noise.Window.to_dict() of the window: steal, others' cores, ...
tune_candidate            -         the candidate plan, as `accelab serve --plan` takes it
tune_round                -         the round (0-based); candidates take turns A B C ... C B A
tune_seq                  -         the window's place in the tune, 0-based
peak_rss_mb               MiB       the peak RSS of the candidate server's processes so far
"""),
)
# the workload keys of a loadtest Result the report reads (run.build_result writes more)
LOADTEST_WORKLOAD: Final = Contract(
    producer="accelab.loadtest.run.build_result (Result.workload)",
    keys=keys("""
endpoint     -      chat | completions | embeddings
rate         req/s  open loop: the rate (find-max: the start rate)
concurrency  -      closed loop: the users
slo          s      the objectives, {ttft, tpot, e2e}: seconds
"""),
)

# -- train ----------------------------------------------------------------------------------------
EVAL: Final = Contract(
    producer="accelab.train.loop._evaluate (one item of `evals`)",
    keys=keys("""
accuracy    fraction  classification: top-1 on the held-out split
perplexity  -         language model: exp(mean token loss) on the held-out split
loss        -         mean loss on the held-out split
samples     -         held-out samples evaluated
tokens      -         language model: held-out tokens evaluated
epoch       -         0-based epoch the evaluation ended
step        -         optimizer step the evaluation followed
wall_s      s         training wall time up to this evaluation (every step, warm-up included; evaluations excluded)
"""),
)
TRAIN: Final = Contract(
    producer="accelab.train.report.result_of (metrics_of: train/timing.py, train/worker.py, train/loop.py)",
    keys=keys("""
samples_per_s              samples/s  samples of the timed steps (all processes) / their wall time
epoch_s                    s          the last full epoch's time, else from the median step (bench rows: timed steps)
epoch_s_estimated          -          epoch_s is an estimate (no full epoch ran, or a bench row)
step_ms                    ms         stats of the timed optimizer steps
timed_steps                -          optimizer steps timed (warm-up steps excluded)
timed_samples              -          samples of the timed steps
timed_wall_s               s          wall time of the timed steps
warmup_s                   s          the warm-up steps, compilation included
step_split                 -          bench rows: where the timed steps' time went (accelab.train.step_split):
                                      phases (data, forward, backward, optimizer, other: p50_ms, share),
                                      communication (DDP all-reduce in flight: p50_ms, share; overlaps
                                      backward), comm, comm_note, steps, total_s, step_p50_ms,
                                      forward_flops_per_sample
steps                      -          optimizer steps run
steps_per_epoch            -          optimizer steps of one epoch
peak_rss_mb_max            MiB        the largest process's peak RSS
peak_rss_mb_sum            MiB        the processes' peak RSS, summed
peak_rss_mb_per_rank       MiB        each process's peak RSS, by rank
gpu_peak_allocated_mb_max  MiB        the largest torch peak GPU allocation over ranks (None on CPU)
state_mb_per_rank          MiB        training state of each rank: parameters, gradients, optimizer state (FSDP: shards)
state_mb_max               MiB        the largest rank's training state
skipped_steps              -          fp16 steps the grad scaler skipped (inf/nan)
first_loss                 -          the first optimizer step's loss
final_loss                 -          the last optimizer step's loss
losses                     -          the training loss of every optimizer step, in order (global batch mean)
evals                      -          every evaluation, in order, each with the EVAL keys
final_accuracy             fraction   the last evaluation's accuracy (classification)
final_perplexity           -          the last evaluation's perplexity (language model)
threads_per_process        -          torch intra-op threads per process
device                     -          the main process's device
wall_s                     s          wall time of the whole launch, from the parent
"""),
)
TRAIN_BENCH: Final = TRAIN.extended(
    "accelab.train.bench (a `train --bench` row: the rows take turns, each turn's noise recorded)",
    *keys("""
noise    -  what the machine did besides the row's turns (accelab.measure.noise.summary), as for bench
rounds   -  every turn of the row: rate (samples/s), seconds, calls (optimizer steps), used, steal,
            others_cores, level
speedup  -  rows after the first: the paired ratio over the first row's turns (accelab.measure.paired.Ratio):
            value, low, high, rounds, dropped, verdict, reason, confidence, reference
achieved_flops  FLOP/s    model FLOP/s of training: 3 x forward FLOPs per sample x samples/s (accelab.train.mfu)
mfu             fraction  achieved_flops over the row's peak: the measured peak of its compute path, scaled
                          to its threads (CPU) or devices (GPU), 0..1
mfu_unknown     -         why the MFU is not reported (no FLOP count or measured peak, or above 100%)
hardware        -         the row's peak: compute_path, peak_flops (scaled), measured_flops, measured_threads
"""),
)
