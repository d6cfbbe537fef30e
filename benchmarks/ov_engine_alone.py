"""OpenVINO GenAI's ContinuousBatchingPipeline alone (no accelab, no socket, no HTTP): tokens/s of
1, 8 and 16 identical prompts decoding 64 greedy tokens each, prefill included, built with the
settings accelab's engine process uses (`openvino_engine.Engine`). Runs in .venv-openvino:

    .venv-openvino/bin/python -P benchmarks/ov_engine_alone.py --config JSON --prompt-ids 1,2,3

`benchmarks/serve_llm.py` calls it for the rate its OpenVINO server is held to; the JSON it
prints maps each size to tokens/s.
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
    parser.add_argument("--prompt-ids", required=True, help="the prompt's token ids, comma-separated")
    parser.add_argument("--sizes", default="1,8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per size; the best is kept")
    opts = parser.parse_args()
    import numpy as np
    import openvino as ov

    module = load_engine_module()
    engine = module.Engine(module.W.OvEngineConfig.from_json(opts.config))
    pipe = engine.pipe
    prompt = ov.Tensor(np.asarray([[int(t) for t in opts.prompt_ids.split(",")]], dtype=np.int64))
    config = pipe.get_config()
    config.max_new_tokens = opts.tokens
    config.ignore_eos = True
    ids = iter(range(10**9))
    rates: dict[int, float] = {}
    for size in (int(s) for s in opts.sizes.split(",")):
        best = 0.0
        for run in range(opts.repeats + 1):  # the first run of a size is a warm-up
            started = time.perf_counter()
            handles = [pipe.add_request(next(ids), prompt, config) for _ in range(size)]
            while pipe.has_non_finished_requests():
                pipe.step()
            produced = sum(len(out.generated_ids) for h in handles for out in h.read_all())
            rate = produced / (time.perf_counter() - started)
            best = max(best, rate) if run else 0.0
        rates[size] = best
    print(json.dumps(rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
