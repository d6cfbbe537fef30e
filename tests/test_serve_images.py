"""Image URLs fetched under the server's guards (accelab.serve.images), against real HTTP servers
on 127.0.0.1: an allowed host is fetched, loopback is refused by default, every redirect is checked
again (by domain and by address), a body past the byte cap, a slow answer and a 404 each fail with
the image named; pixels per image have their cap too.

The connection goes to the address that was checked: under a faked DNS that rebinds a name to
127.0.0.1 after its first answer, no fetch reaches the loopback server, first hop or redirect; and
https verifies the URL's name at that address (a local TLS server with a CA of the test's own)."""

from __future__ import annotations

import collections
import contextlib
import datetime
import http.server
import io
import ipaddress
import re
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from urllib.parse import parse_qs, quote, urlsplit

import pytest
from PIL import Image

from accelab.serve.images import ImagePolicy, ImageRefused, ImageTooLarge, check_url, decode_image, fetch_image


def png(width: int = 8, height: int = 6) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        port = self.server.server_address[1]
        self.server.seen.append((self.path, self.headers["Host"]))  # type: ignore[attr-defined]
        routes = {
            "/cat.png": (200, {"Content-Type": "image/png"}, png()),
            "/wide.png": (200, {"Content-Type": "image/png"}, png(400, 300)),
            "/big.bin": (200, {}, b"x" * 50_000),
            "/to-loopback": (302, {"Location": f"http://127.0.0.1:{port}/cat.png"}, b""),
            "/relative": (302, {"Location": "/cat.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
        }
        path = urlsplit(self.path)
        if path.path == "/redirect":  # /redirect?to=URL
            routes[self.path] = (302, {"Location": parse_qs(path.query)["to"][0]}, b"")
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


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that stopped reading (the byte cap)
            super().handle_error(request, client_address)


@contextlib.contextmanager
def local_server(tls: ssl.SSLContext | None = None) -> Iterator[http.server.ThreadingHTTPServer]:
    """An image server on 127.0.0.1 (https with `tls`); `.seen` lists each request's (path, Host)."""
    server = QuietServer(("127.0.0.1", 0), Handler)
    server.seen = []  # type: ignore[attr-defined]
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def port_of(server: http.server.ThreadingHTTPServer) -> int:
    return server.server_address[1]


@pytest.fixture(scope="module")
def site_server():
    with local_server() as server:
        yield server


@pytest.fixture(scope="module")
def site(site_server) -> str:
    return f"http://localhost:{port_of(site_server)}"


@pytest.fixture(scope="module")
def port(site_server) -> int:
    """The site's port."""
    return port_of(site_server)


@pytest.fixture
def target():
    """A server that DNS rebinding would aim at: a test asserts that it is never reached."""
    with local_server() as server:
        yield server


PUBLIC = "93.184.216.34"  # a public address; the fake network routes it to servers on this machine
DOWN = "93.184.216.35"  # a public address where nothing answers
_getaddrinfo, _create_connection = socket.getaddrinfo, socket.create_connection


class RebindingNetwork:
    """DNS and the network, faked for one test (through `monkeypatch`, for accelab's lookups and
    httpx's connections alike): a name answers `first` on its first lookup and 127.0.0.1 on every
    later one (DNS rebinding); a connection asked for by name resolves it again, as the system's
    would. PUBLIC's ports in `reachable` reach this machine's same ports, 127.0.0.1 is this machine,
    and anything else is refused. `connects`: the (host, port) each connection was asked for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, reachable=(), first: tuple[str, ...] = (PUBLIC,)):
        self.reachable, self.first = set(reachable), first
        self.lookups: collections.Counter[str] = collections.Counter()
        self.connects: list[tuple[str, int]] = []
        monkeypatch.setattr(socket, "getaddrinfo", self.getaddrinfo)
        monkeypatch.setattr(socket, "create_connection", self.create_connection)

    def getaddrinfo(self, host, port, *args, **kwargs):
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(host)
            return _getaddrinfo(host, port, *args, **kwargs)  # an address resolves to itself
        self.lookups[host] += 1
        answer = self.first if self.lookups[host] == 1 else ("127.0.0.1",)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, port)) for ip in answer]

    def create_connection(self, address, *args, **kwargs):
        host, port = address
        self.connects.append((host, port))
        ip = self.getaddrinfo(host, port)[0][4][0]
        if ip == PUBLIC and port in self.reachable:
            return _create_connection(("127.0.0.1", port), *args, **kwargs)
        if ipaddress.ip_address(ip).is_loopback:
            return _create_connection((ip, port), *args, **kwargs)  # a rebound name reaches this machine
        raise ConnectionRefusedError(111, f"fake network: nothing answers at {ip}:{port}")


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


def test_a_redirect_to_a_private_address_is_refused(port, monkeypatch):
    """DNS that calls a name public, and routes that address to the site, lets the first hop
    through; its redirect to 127.0.0.1 is refused."""
    RebindingNetwork(monkeypatch, reachable={port})
    assert check_url(f"http://cdn.test:{port}/cat.png", ImagePolicy()) == (PUBLIC,)
    with pytest.raises(ImageRefused, match=r"127\.0\.0\.1 resolves to 127\.0\.0\.1, a private, loopback"):
        fetch_image(f"http://images.test:{port}/to-loopback", ImagePolicy())
    with pytest.raises(ImageRefused, match=r"10\.1\.2\.3, a private"):
        check_url("http://10.1.2.3/x.png", ImagePolicy())


def test_a_name_that_rebinds_to_loopback_is_fetched_from_the_address_checked(site_server, port, target, monkeypatch):
    """The name answers a public address to the check and 127.0.0.1 to any later lookup: the fetch
    connects to the address it checked, the URL's name in its Host header, and never reaches the
    loopback server (here nothing answers at the checked address, so the fetch fails)."""
    trap = port_of(target)
    network = RebindingNetwork(monkeypatch, reachable={port})
    assert fetch_image(f"http://cdn.test:{port}/cat.png", ImagePolicy()) == png()
    assert site_server.seen[-1] == ("/cat.png", f"cdn.test:{port}")
    with pytest.raises(
        ImageRefused, match=rf"could not fetch http://rebind\.test:{trap}/cat\.png: .*{re.escape(PUBLIC)}:{trap}"
    ):
        fetch_image(f"http://rebind.test:{trap}/cat.png", ImagePolicy())
    assert network.connects == [(PUBLIC, port), (PUBLIC, trap)]
    assert network.lookups == {"cdn.test": 1, "rebind.test": 1}
    assert target.seen == []


def test_a_redirect_to_a_name_that_rebinds_is_fetched_from_the_address_checked(site_server, port, target, monkeypatch):
    """Each hop is resolved, checked and connected to on its own: a redirect to a rebinding name
    never reaches the loopback server, and one whose checked address answers is fetched there."""
    trap = port_of(target)
    network = RebindingNetwork(monkeypatch, reachable={port})
    hop = quote(f"http://rebind.test:{trap}/cat.png")
    with pytest.raises(
        ImageRefused, match=rf"could not fetch http://rebind\.test:{trap}/cat\.png: .*{re.escape(PUBLIC)}:{trap}"
    ):
        fetch_image(f"http://cdn.test:{port}/redirect?to={hop}", ImagePolicy())
    assert network.connects == [(PUBLIC, port), (PUBLIC, trap)]
    assert target.seen == []

    hop = quote(f"http://rebind2.test:{port}/cat.png")
    assert fetch_image(f"http://cdn2.test:{port}/redirect?to={hop}", ImagePolicy()) == png()
    assert network.connects[2:] == [(PUBLIC, port), (PUBLIC, port)]
    assert site_server.seen[-1] == ("/cat.png", f"rebind2.test:{port}")
    assert network.lookups == {"cdn.test": 1, "rebind.test": 1, "cdn2.test": 1, "rebind2.test": 1}


def test_every_address_is_checked_and_the_next_checked_one_is_tried(port, monkeypatch):
    network = RebindingNetwork(monkeypatch, reachable={port}, first=(DOWN, PUBLIC))
    assert fetch_image(f"http://cdn.test:{port}/cat.png", ImagePolicy()) == png()
    assert network.connects == [(DOWN, port), (PUBLIC, port)]  # the resolver's order, each address once

    network = RebindingNetwork(monkeypatch, reachable={port}, first=(PUBLIC, "10.0.0.7"))
    with pytest.raises(ImageRefused, match=r"image 3: cdn\.test resolves to 10\.0\.0\.7, a private"):
        fetch_image(f"http://cdn.test:{port}/cat.png", ImagePolicy(), where="image 3")
    assert network.connects == []


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


# -- TLS at the pinned address -------------------------------------------------------------------
def issue(name: str, key, issuer: str, issuer_key):
    """A certificate for `name` signed by `issuer`'s key: a CA's when the two are the same, else a
    server's with `name` as its DNS name (the extensions Python's strict verification asks for)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca = key is issuer_key
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    )
    if ca:
        signs = {"digital_signature": True, "key_cert_sign": True, "crl_sign": True}
        others = ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement")
        usage = x509.KeyUsage(**signs, **dict.fromkeys(others, False), encipher_only=False, decipher_only=False)
        builder = builder.add_extension(usage, critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def tls_sites(tmp_path_factory):
    """Two https image servers on 127.0.0.1 with certificates from a CA of the test's own, one for
    images.test and one for other.test. Yields the CA's file and the two servers; each server's
    `.names` lists the server names (SNI) its handshakes were sent."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = tmp_path_factory.mktemp("tls")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_file = folder / "ca.pem"
    ca_file.write_bytes(
        issue("accelab test CA", ca_key, "accelab test CA", ca_key).public_bytes(serialization.Encoding.PEM)
    )
    with contextlib.ExitStack() as stack:
        servers = []
        for name in ("images.test", "other.test"):
            key = ec.generate_private_key(ec.SECP256R1())
            chain = folder / f"{name}.pem"
            chain.write_bytes(
                issue(name, key, "accelab test CA", ca_key).public_bytes(serialization.Encoding.PEM)
                + key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(chain)
            names: list[str | None] = []
            context.sni_callback = lambda _socket, sni, _context, names=names: names.append(sni)
            server = stack.enter_context(local_server(context))
            server.names = names  # type: ignore[attr-defined]
            servers.append(server)
        yield ca_file, *servers


def test_tls_verifies_the_urls_name_at_the_address_it_connects_to(tls_sites, monkeypatch):
    """images.test resolves (faked) to 127.0.0.1: the connection goes there, sends images.test
    as the server name and in the Host header, and trusts the certificate only if it is for
    images.test and from a CA the fetch was given."""
    ca_path, good, wrong = tls_sites
    RebindingNetwork(monkeypatch, first=("127.0.0.1",))  # every answer 127.0.0.1, allowed by the policy
    policy, trusted = ImagePolicy(allow_private=True), ssl.create_default_context(cafile=str(ca_path))

    url = f"https://images.test:{port_of(good)}/cat.png"
    assert fetch_image(url, policy, tls=trusted) == png()
    assert good.names == ["images.test"] and good.seen == [("/cat.png", f"images.test:{port_of(good)}")]
    with pytest.raises(
        ImageRefused, match=r"could not fetch .*certificate verify failed: Hostname mismatch.*'images\.test'"
    ):
        fetch_image(f"https://images.test:{port_of(wrong)}/cat.png", policy, tls=trusted)  # other.test's
    with pytest.raises(ImageRefused, match=r"could not fetch .*certificate verify failed: unable to get local issuer"):
        fetch_image(url, policy)  # by default the CAs are certifi's, which do not know the test's
    assert wrong.seen == [] and good.seen == [("/cat.png", f"images.test:{port_of(good)}")]


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
