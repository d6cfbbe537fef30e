"""Image URLs fetched under the server's guards (accelab.serve.images), against a real HTTP server
on 127.0.0.1: an allowed host is fetched, loopback is refused by default, every redirect is checked
again (by domain and by address), a body past the byte cap, a slow answer and a 404 each fail with
the image named; pixels per image have their cap too."""

from __future__ import annotations

import http.server
import io
import threading
import time
from types import SimpleNamespace

import pytest
from PIL import Image

from accelab.serve import images
from accelab.serve.images import ImagePolicy, ImageRefused, ImageTooLarge, check_url, decode_image, fetch_image


def png(width: int = 8, height: int = 6) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        port = self.server.server_address[1]
        routes = {
            "/cat.png": (200, {"Content-Type": "image/png"}, png()),
            "/wide.png": (200, {"Content-Type": "image/png"}, png(400, 300)),
            "/big.bin": (200, {}, b"x" * 50_000),
            "/to-loopback": (302, {"Location": f"http://127.0.0.1:{port}/cat.png"}, b""),
            "/relative": (302, {"Location": "/cat.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
        }
        if self.path == "/slow":
            time.sleep(1.5)
        status, headers, body = routes.get(self.path, (404, {}, b"no such image"))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def site():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://localhost:{server.server_address[1]}"
    server.shutdown()


LOCAL = ImagePolicy(domains=("localhost",), allow_private=True)  # what a test may fetch from its own machine


def test_an_allowed_host_is_fetched_and_decoded(site):
    assert fetch_image(f"{site}/cat.png", LOCAL) == png()
    image = decode_image(f"{site}/cat.png", policy=LOCAL)
    assert image.size == (8, 6) and image.mode == "RGB"
    assert decode_image(f"{site}/relative", policy=LOCAL).size == (8, 6)  # a relative redirect, same host


def test_loopback_is_refused_by_default_and_urls_without_a_policy(site):
    with pytest.raises(ImageRefused, match=r"image 2: localhost resolves to 127\.0\.0\.1.*--allow-private-images"):
        fetch_image(f"{site}/cat.png", ImagePolicy(), where="image 2")
    with pytest.raises(ImageRefused, match="does not fetch URLs"):
        decode_image(f"{site}/cat.png")
    with pytest.raises(ImageRefused, match="not an http"):
        check_url("ftp://localhost/cat.png", LOCAL)


def test_a_host_outside_the_allow_list_and_a_redirect_out_of_it_are_refused(site):
    with pytest.raises(ImageRefused, match=r"localhost is not among the domains .*images\.example\.org"):
        fetch_image(f"{site}/cat.png", ImagePolicy(domains=("images.example.org",), allow_private=True))
    with pytest.raises(ImageRefused, match=r"127\.0\.0\.1 is not among the domains"):
        fetch_image(f"{site}/to-loopback", LOCAL)  # the redirect's host is checked again


def test_a_redirect_to_a_private_address_is_refused(site, monkeypatch):
    """DNS that calls localhost public (a FAKE resolver for the check only: the client still
    connects to this machine) lets the first hop through; its redirect to 127.0.0.1 is refused."""

    def resolve(host, port, proto=0):
        address = "93.184.216.34" if host == "localhost" else host
        return [(2, 1, 6, "", (address, port))]

    monkeypatch.setattr(images, "socket", SimpleNamespace(getaddrinfo=resolve, IPPROTO_TCP=6))
    check_url(f"{site}/cat.png", ImagePolicy())  # "public" now
    with pytest.raises(ImageRefused, match=r"127\.0\.0\.1 resolves to 127\.0\.0\.1, a private, loopback"):
        fetch_image(f"{site}/to-loopback", ImagePolicy())
    with pytest.raises(ImageRefused, match=r"10\.1\.2\.3, a private"):
        check_url("http://10.1.2.3/x.png", ImagePolicy())


def test_size_time_and_status_limits_name_the_image(site):
    with pytest.raises(ImageTooLarge, match=r"image 0: .*/big\.bin is larger .*1,000 bytes, --max-image-bytes"):
        fetch_image(
            f"{site}/big.bin", ImagePolicy(domains=("localhost",), allow_private=True, max_bytes=1000), where="image 0"
        )
    with pytest.raises(ImageRefused, match=r"/slow did not answer within 0\.3 s"):
        fetch_image(f"{site}/slow", ImagePolicy(allow_private=True, timeout_s=0.3))
    with pytest.raises(ImageRefused, match=r"image 1: fetching .*/missing answered HTTP 404"):
        fetch_image(f"{site}/missing", LOCAL, where="image 1")
    with pytest.raises(ImageRefused, match="more than 3 redirects"):
        fetch_image(f"{site}/loop", LOCAL)
    with pytest.raises(ImageTooLarge, match=r"400x300 pixels is more than this server takes \(10,000"):
        decode_image(f"{site}/wide.png", policy=ImagePolicy(allow_private=True, max_pixels=10_000))


def test_the_server_options_make_the_policy():
    from accelab.serve.config import ServeConfig

    config = ServeConfig(model_name="m", image_domains=" Images.Example.org, .cdn.example.com ", max_images=2)
    policy = config.image_policy()
    assert policy.domains == ("images.example.org", "cdn.example.com") and policy.max_images == 2
    assert not policy.allow_private and policy.timeout_s == 10.0
    with pytest.raises(ValueError, match="max_images=0 must be 1 or more"):
        ServeConfig(model_name="m", max_images=0)
    with pytest.raises(ValueError, match="encoder_batch=0 must be 1 or more"):
        ServeConfig(model_name="m", encoder_batch=0)
