"""Images a chat load test sends (`accelab loadtest --images`), as data URIs:

sample[:N]     accelab's sample photos (14 distinct real photos; N in turn, default 14): a
               repeated pool, what an encoder cache or a prefix cache can reuse
generated[:N]  N distinct random-noise images of 224x224 (default 64), made from --seed: unique
               images, nothing to reuse
DIR            every .png, .jpg, .jpeg and .webp file in a folder (your own images)
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

from PIL import Image

MIME = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}
GENERATED_SIZE = 224


def load_images(spec: str | None, *, seed: int = 0) -> tuple[str, ...]:
    """The data URIs `--images SPEC` names (see the module's doc); ValueError says what is wrong."""
    if not spec:
        return ()
    kind, _, count = spec.partition(":")
    if kind in ("sample", "generated"):
        if count and not (count.isdecimal() and int(count) >= 1):
            raise ValueError(f"--images {spec}: the count after ':' must be a whole number of 1 or more")
        n = int(count) if count else (14 if kind == "sample" else 64)
        return tuple(_png(image) for image in (_samples(n) if kind == "sample" else _generated(n, seed)))
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ValueError(f"--images {spec}: not a folder, nor sample[:N] or generated[:N]")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in MIME and p.is_file())
    if not files:
        raise ValueError(f"--images {spec}: the folder has no {', '.join(MIME)} file")
    return tuple(f"data:{MIME[p.suffix.lower()]};base64," + base64.b64encode(p.read_bytes()).decode() for p in files)


def _samples(n: int) -> list[Image.Image]:
    from accelab.catalog.samples import photos

    return photos(n)


def _generated(n: int, seed: int) -> list[Image.Image]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (GENERATED_SIZE, GENERATED_SIZE, 3), dtype=np.uint8), "RGB")
        for _ in range(n)
    ]


def _png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
