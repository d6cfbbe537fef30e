"""Prompt log-probabilities for accelab's OpenVINO GenAI engine process (`openvino_engine.py`): the
ContinuousBatchingPipeline returns none, so a `Score` (perplexity) runs on its client's reader thread
through the exported graph itself, compiled apart from the pipeline on the first one.

Standard library at the top, numpy and openvino inside (no accelab in the OpenVINO GenAI venv): the
engine process loads this file by its path, as it loads `engine_wire.py`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any


class Scorer:
    """The exported graph of the engine's model, compiled on the first `score`; one scoring at a time."""

    def __init__(self, config: Any):
        self.config = config  # the engine's OvEngineConfig: the export, its precision and threads
        self._compiled: Any = None
        self._lock = threading.Lock()

    def score(self, prompt_ids: list[int], top_k: int = 0) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """log p(token i | tokens < i), i >= 1, from the exported graph's logits at the pipeline's
        precision (the weights are the same file); with top_k > 0 also the top_k ids and
        log-probabilities at each of those positions (from the full logits: any k)."""
        import numpy as np

        with self._lock:
            if self._compiled is None:
                import openvino as ov

                properties = {"INFERENCE_PRECISION_HINT": self.config.precision}
                if self.config.threads:
                    properties["INFERENCE_NUM_THREADS"] = self.config.threads
                self._compiled = ov.Core().compile_model(
                    str(Path(self.config.model) / "openvino_model.xml"), "CPU", properties
                )
            request = self._compiled.create_infer_request()
            request.reset_state()
            ids = np.asarray([prompt_ids], dtype=np.int64)
            feeds = {
                "input_ids": ids,
                "attention_mask": np.ones_like(ids),
                "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
                "beam_idx": np.zeros(1, dtype=np.int32),
            }
            logits = np.asarray(request.infer(feeds)["logits"][0], dtype=np.float64)  # [S, V]
        peak = logits.max(-1, keepdims=True)
        logprobs = logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))
        targets = [float(logprobs[i, t]) for i, t in enumerate(prompt_ids[1:])]
        if top_k <= 0:
            return targets, [], []
        rows = logprobs[: len(prompt_ids) - 1]  # position i predicts token i + 1
        top = np.argpartition(-rows, top_k - 1, axis=-1)[:, :top_k]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(rows, top, -1), axis=-1), -1)  # likeliest first
        return targets, top.tolist(), np.take_along_axis(rows, top, -1).tolist()
