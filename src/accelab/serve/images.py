"""Images sent in requests: data URIs or bare base64, decoded to RGB PIL images."""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, UnidentifiedImageError

MAX_PIXELS = 40_000_000  # a decompression bomb guard: 40 MP is more than any model here takes


def decode_image(data: str, *, where: str = "image") -> Image.Image:
    """`data:image/png;base64,...` or bare base64 -> an RGB image; ValueError says what is wrong."""
    if data.startswith(("http://", "https://")):
        raise ValueError(
            f"{where}: this server does not fetch URLs; send the image inline as data:image/png;base64,..."
        )
    if data.startswith("data:"):
        header, sep, payload = data.partition(",")
        if not sep or ";base64" not in header:
            raise ValueError(f"{where}: a data URI must look like data:image/png;base64,<base64 bytes>")
    else:
        payload = data
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the image is not valid base64") from None
    try:
        image = Image.open(io.BytesIO(raw))
        if image.width * image.height > MAX_PIXELS:
            raise ValueError(f"{where}: {image.width}x{image.height} pixels is more than {MAX_PIXELS:,}")
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError):
        raise ValueError(f"{where}: the bytes are not an image PIL can read (PNG, JPEG, WebP, ...)") from None


def encode_png(image: Image.Image) -> str:
    """An image as a data URI (for clients and tests)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
