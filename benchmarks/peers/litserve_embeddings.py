"""A LitServe peer for benchmarks/serve_batching.py: the same MiniLM directory, the same pooling
(mean over real tokens, L2 norm), the same thread count, and OpenAI's /v1/embeddings shape with
base64 vectors, so accelab's load test drives both servers alike. LitServe runs its API server
and its inference worker as separate processes and batches requests itself.

    python benchmarks/peers/litserve_embeddings.py MODEL_DIR --port 8001 --max-batch-size 16 --batch-timeout 0.01
"""

from __future__ import annotations

import argparse
import base64

import litserve as ls
import numpy as np
import torch


class MiniLMEmbeddings(ls.LitAPI):
    def __init__(self, model_dir: str, threads: int, **kwargs):
        super().__init__(**kwargs)
        self.model_dir = model_dir
        self.threads = threads

    def setup(self, device: str) -> None:
        from transformers import AutoModel, AutoTokenizer

        torch.set_num_threads(self.threads)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModel.from_pretrained(self.model_dir, dtype=torch.float32).eval()

    def decode_request(self, request: dict) -> str:
        return request["input"]

    def predict(self, texts: list[str]) -> list[np.ndarray]:
        batch = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state  # [B, S, H]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return list(torch.nn.functional.normalize(pooled, dim=-1).numpy())

    def encode_response(self, vector: np.ndarray) -> dict:
        data = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": data}],
            "model": "minilm-l6",
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--batch-timeout", type=float, default=0.01)
    args = parser.parse_args()
    api = MiniLMEmbeddings(
        args.model_dir,
        args.threads,
        max_batch_size=args.max_batch_size,
        batch_timeout=args.batch_timeout,
        api_path="/v1/embeddings",
    )
    ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=30).run(
        port=args.port, generate_client_file=False
    )


if __name__ == "__main__":
    main()
