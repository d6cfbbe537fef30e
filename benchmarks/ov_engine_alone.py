"""OpenVINO GenAI's ContinuousBatchingPipeline alone (no accelab, no socket, no HTTP), built with
the settings accelab's engine process uses (`openvino_engine.Engine`). Two figures per number of
sequences:

- lockstep: that many copies of the first prompt decoding 64 greedy tokens each, prefill included;
- closed loop: the served load without the server: that many users, each sending the next prompt
  with the next max_tokens of the mix as soon as its last request ended (end of sequence allowed),
  for `--seconds` after a warm-up: the rate a server in front of this pipeline can at most reach.

    .venv-openvino/bin/python -P benchmarks/ov_engine_alone.py --config JSON --prompts FILE.json

FILE.json: {"prompts": [[ids], ...], "mix": [16, 128, ...]}. `benchmarks/serve_llm.py` calls it;
the JSON it prints is {"lockstep": {size: tok/s}, "closed_loop": {size: tok/s}}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "src" / "accelab" / "backends" / "openvino_engine.py"


def load_engine_module():
    spec = importlib.util.spec_from_file_location("accelab_openvino_engine", ENGINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="OvEngineConfig as JSON (accelab.backends.openvino_genai)")
    parser.add_argument("--prompts", required=True, help="JSON file: prompts as token ids, and the max_tokens mix")
    parser.add_argument("--sizes", default="1,8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="lockstep runs per size; the best is kept")
    parser.add_argument("--seconds", type=float, default=15.0, help="closed-loop window per size")
    opts = parser.parse_args()

    module = load_engine_module()
    engine = module.Engine(module.W.OvEngineConfig.from_json(opts.config))
    load = json.loads(Path(opts.prompts).read_text())
    sizes = [int(s) for s in opts.sizes.split(",")]
    print(
        json.dumps(
            {
                "lockstep": lockstep(engine.pipe, load["prompts"][0], sizes, opts.tokens, opts.repeats),
                "closed_loop": {n: closed_loop(engine.pipe, load, n, opts.seconds) for n in sizes},
            }
        )
    )
    return 0


def tensor(ids: list[int]):
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.asarray([ids], dtype=np.int64))


IDS = iter(range(10**9))


def lockstep(pipe, prompt_ids: list[int], sizes: list[int], tokens: int, repeats: int) -> dict[int, float]:
    prompt = tensor(prompt_ids)
    config = pipe.get_config()
    config.max_new_tokens = tokens
    config.ignore_eos = True
    ids = IDS
    rates: dict[int, float] = {}
    for size in sizes:
        best = 0.0
        for run in range(repeats + 1):  # the first run of a size is a warm-up
            started = time.perf_counter()
            handles = [pipe.add_request(next(ids), prompt, config) for _ in range(size)]
            while pipe.has_non_finished_requests():
                pipe.step()
            produced = sum(len(out.generated_ids) for h in handles for out in h.read_all())
            rate = produced / (time.perf_counter() - started)
            best = max(best, rate) if run else 0.0
        rates[size] = best
    return rates


def closed_loop(pipe, load: dict, users: int, seconds: float, warmup_s: float = 3.0) -> float:
    """Generated tokens/s over `seconds` of `users` back-to-back request streams."""
    import openvino_genai as genai

    prompts, mix = load["prompts"], load["mix"]
    sent = iter(range(10**9))

    def send():
        k = next(sent)
        config = pipe.get_config()
        config.max_new_tokens = mix[k % len(mix)]
        return pipe.add_request(next(IDS), tensor(prompts[k % len(prompts)]), config)

    live = [send() for _ in range(users)]
    started = time.perf_counter()
    counting_from, produced = started + warmup_s, 0
    while time.perf_counter() < counting_from + seconds:
        pipe.step()
        now = time.perf_counter()
        for i, handle in enumerate(live):
            while handle.can_read():
                new = sum(len(out.generated_ids) for out in handle.read().values())
                produced += new if now >= counting_from else 0
            if handle.get_status() != genai.GenerationStatus.RUNNING:
                live[i] = send()
    for handle in live:
        handle.stop()
    while pipe.has_non_finished_requests():
        pipe.step()
    return produced / seconds


if __name__ == "__main__":
    raise SystemExit(main())
