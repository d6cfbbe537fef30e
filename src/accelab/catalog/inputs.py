"""Real sample inputs for every task and the batch builders the benchmarks use.

Data: `prompts`, `image_prompts`, `sentences`, `heldout_text`, `evaluation_text`, `photos`, `digits` (see
`samples`). Batches: `forward_batch`, `generate_batch` (see `batches`). Embeddings: `embed`.
"""

from __future__ import annotations

from accelab.catalog.batches import forward_batch, generate_batch
from accelab.catalog.embedding import embed
from accelab.catalog.samples import (
    digits,
    evaluation_digest,
    evaluation_text,
    heldout_text,
    image_prompts,
    photos,
    prompts,
    sentences,
)

__all__ = [
    "digits",
    "embed",
    "evaluation_digest",
    "evaluation_text",
    "forward_batch",
    "generate_batch",
    "heldout_text",
    "image_prompts",
    "photos",
    "prompts",
    "sentences",
]
