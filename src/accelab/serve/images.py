"""Images sent in requests: data URIs, bare base64, or http(s) URLs fetched under the server's
guards (`ImagePolicy`), decoded to RGB PIL images.

The guards, every one a server option: an allow-list of domains (`--image-domains`; empty: any
public host); hosts that resolve to a private, loopback, link-local or reserved address are refused
unless `--allow-private-images` (a server must not be a way into its own network), and each redirect
is checked again the same way; a timeout and a byte cap per image; a cap on pixels per image and on
images per request. A refused or failed fetch is a 400 that names the image; a cap passed, a 413.

Each hop's host is resolved once, here, and the connection goes to an address that was checked
(OWASP's SSRF advice), never to a name the HTTP client resolves again: a DNS answer that changes
after the check (DNS rebinding) is not used. The request keeps the URL's name in its Host header,
and TLS sends it as the server name and verifies the certificate against it (httpx's documented
`sni_hostname` request extension).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import ipaddress
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

from PIL import Image, ImageDraw, UnidentifiedImageError

if TYPE_CHECKING:
    import ssl

    import httpx

MAX_PIXELS = 40_000_000  # a decompression bomb guard: 40 MP is more than any model here takes
MAX_REDIRECTS = 3


class ImageRefused(ValueError):
    """An image the server will not take or could not fetch: the server answers 400 naming it."""


class ImageTooLarge(ValueError):
    """An image past a size limit of this server (bytes, pixels): the server answers 413."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ImagePolicy:
    domains: tuple[str, ...] = ()  # hosts (and their subdomains) URLs may name; empty: any public host
    allow_private: bool = False  # fetch from private, loopback and link-local addresses too
    timeout_s: float = 10.0  # per fetch, each redirect included
    max_bytes: int = 20 * 1024 * 1024  # per fetched image
    max_pixels: int = MAX_PIXELS  # per image, however it came
    max_images: int = 8  # per request


def decode_image(data: str | bytes, *, where: str = "image", policy: ImagePolicy | None = None) -> Image.Image:
    """`data:image/png;base64,...`, bare base64, an http(s) URL or the bytes fetched from one
    (`fetch_remote`) -> an RGB image; ImageRefused (400) or ImageTooLarge (413) say what is wrong.
    Without a policy, URLs are refused."""
    max_pixels = policy.max_pixels if policy is not None else MAX_PIXELS
    if isinstance(data, bytes):
        return _open(data, where, max_pixels)
    if is_url(data):
        return _open(fetch_checked(data, policy, where=where), where, max_pixels)
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
    return _open(raw, where, max_pixels)


def is_url(data: object) -> bool:
    return isinstance(data, str) and data.startswith(("http://", "https://"))


def fetch_remote(messages: list[dict[str, Any]], policy: ImagePolicy | None) -> list[dict[str, Any]]:
    """A chat's engine messages with each http(s) image fetched: its bytes in place of its URL
    (images numbered as `decode_image` names them). For the continuous worker, which processes a
    request's images on its own thread between the steps: it must not wait on the network there."""
    index = -1

    def fetched(part: dict[str, Any]) -> dict[str, Any]:
        nonlocal index
        if part["type"] != "image":
            return part
        index += 1
        return (
            {**part, "url": fetch_checked(part["url"], policy, where=f"image {index}")} if is_url(part["url"]) else part
        )

    return [
        {**m, "content": [fetched(part) for part in m["content"]]} if isinstance(m["content"], list) else m
        for m in messages
    ]


def fetch_checked(url: str, policy: ImagePolicy | None, *, where: str) -> bytes:
    if policy is None:
        raise ImageRefused(
            f"{where}: this server does not fetch URLs; send the image inline as data:image/png;base64,..."
        )
    return fetch_image(url, policy, where=where)


def _open(raw: bytes, where: str, max_pixels: int) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(raw))
        if image.width * image.height > max_pixels:
            raise ImageTooLarge(
                f"{where}: {image.width}x{image.height} pixels is more than this server takes ({max_pixels:,}, "
                "--max-image-pixels): send a smaller image"
            )
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError):
        raise ValueError(f"{where}: the bytes are not an image PIL can read (PNG, JPEG, WebP, ...)") from None


# -- fetching ------------------------------------------------------------------------------------
def fetch_image(url: str, policy: ImagePolicy, *, where: str = "image", tls: ssl.SSLContext | None = None) -> bytes:
    """The bytes at `url`, following up to MAX_REDIRECTS redirects, each checked by `policy` and
    fetched from an address `check_url` checked. `tls`: the certificate authorities https servers
    are verified with (default: certifi's, as httpx's own default; a private CA, or a test's)."""
    import httpx

    # no connection kept between hops: two names on one address must each get their own TLS
    # handshake, verified for their own name, not the connection the first one opened
    limits = httpx.Limits(max_keepalive_connections=0)
    verify: ssl.SSLContext | bool = tls if tls is not None else True
    with httpx.Client(
        timeout=policy.timeout_s, follow_redirects=False, trust_env=False, verify=verify, limits=limits
    ) as client:
        for _ in range(MAX_REDIRECTS + 1):
            addresses = check_url(url, policy, where=where)
            try:
                with _get_pinned(client, url, addresses) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code >= 400:
                        raise ImageRefused(f"{where}: fetching {url} answered HTTP {response.status_code}")
                    return _read_capped(response, policy.max_bytes, where, url)
            except httpx.TimeoutException:
                raise ImageRefused(f"{where}: {url} did not answer within {policy.timeout_s:g} s") from None
            except httpx.HTTPError as err:
                raise ImageRefused(f"{where}: could not fetch {url}: {err}") from None
    raise ImageRefused(f"{where}: more than {MAX_REDIRECTS} redirects from {url}")


@contextlib.contextmanager
def _get_pinned(client: httpx.Client, url: str, addresses: tuple[str, ...]) -> Iterator[httpx.Response]:
    """GET `url` over a connection to one of `addresses` (the first that takes one, in the
    resolver's order, as `socket.create_connection` tries a name's): the request line and Host
    header name the URL's host, and TLS verifies that name, whatever address it connects to."""
    import httpx

    target = httpx.URL(url)
    for tried, address in enumerate(addresses, start=1):
        # built for the URL, so its Host header names the URL's host; then sent to the address
        request = client.build_request("GET", target, extensions={"sni_hostname": target.raw_host.decode("ascii")})
        request.url = target.copy_with(host=address)
        try:
            response = client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            if tried == len(addresses):
                raise
            continue
        try:
            yield response
        finally:
            response.close()
        return


def _read_capped(response: object, cap: int, where: str, url: str) -> bytes:
    too_big = ImageTooLarge(
        f"{where}: {url} is larger than this server takes per image ({cap:,} bytes, --max-image-bytes)"
    )
    declared = response.headers.get("content-length", "")  # type: ignore[attr-defined]
    if declared.isdecimal() and int(declared) > cap:
        raise too_big
    data = bytearray()
    for chunk in response.iter_bytes():  # type: ignore[attr-defined]
        data += chunk
        if len(data) > cap:
            raise too_big
    return bytes(data)


def check_url(url: str, policy: ImagePolicy, *, where: str = "image") -> tuple[str, ...]:
    """The addresses `url`'s host resolves to, the one lookup a fetch makes for it; ImageRefused
    unless `url` is http(s), on an allowed domain, and every address is public (or the policy
    allows private ones). Connect to these, never to the name again: its next answer is unchecked."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    if parts.scheme not in ("http", "https") or not host:
        raise ImageRefused(f"{where}: {url!r} is not an http(s) URL with a host")
    if policy.domains and not any(host == d or host.endswith("." + d) for d in policy.domains):
        raise ImageRefused(
            f"{where}: {host} is not among the domains this server fetches images from "
            f"({', '.join(policy.domains)}; --image-domains)"
        )
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except (OSError, ValueError) as err:
        raise ImageRefused(f"{where}: cannot resolve {host}: {err}") from None
    addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))  # the resolver's order, once each
    if not addresses:
        raise ImageRefused(f"{where}: cannot resolve {host}: no address")
    if not policy.allow_private:
        for address in addresses:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
            if not ip.is_global:
                raise ImageRefused(
                    f"{where}: {host} resolves to {ip}, a private, loopback or reserved address, which this "
                    "server does not fetch from (--allow-private-images to allow it)"
                )
    return addresses


def encode_png(image: Image.Image) -> str:
    """An image as a data URI (for clients and tests)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def check_image() -> Image.Image:
    """A picture with some structure (a gradient with a square), for start-up checks."""
    image = Image.linear_gradient("L").convert("RGB").resize((96, 80))
    ImageDraw.Draw(image).rectangle((20, 16, 60, 50), fill=(200, 40, 40))
    return image
