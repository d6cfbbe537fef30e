"""A local stand-in for the Hugging Face Hub on 127.0.0.1: real HTTP, in the Hub's URL layout, for
the real huggingface_hub client (`HF_ENDPOINT=hub.url`). Test code, not shipped in the package.

What huggingface_hub 2.x asks of it, read from its source:
- `snapshot_download` calls GET /api/models/{repo}/revision/{rev} (the `sha` field is the commit)
  unless the revision already is a 40-hex commit, then GET /api/models/{repo}/tree/{commit}
  ?recursive=True (a JSON list of files; pages would follow a `Link` header), then for each file
  HEAD and GET /{repo}/resolve/{commit}/{path}.
- HEAD must carry X-Repo-Commit, ETag (the blob's file name in the cache) and Content-Length;
  the GET streams the bytes and serves `Range: bytes=N-` with 206 (a dropped connection is resumed
  that way, in the same process).
- Errors are told apart by X-Error-Code: RepoNotFound (404, or 401 to a caller without a valid
  token, as the Hub answers so that private repositories cannot be probed), GatedRepo (401/403 on a
  gated repository's files), RevisionNotFound (404), EntryNotFound (404). A token the Hub does not
  know gets 401 with X-Error-Message "Invalid credentials in Authorization header".

Fault switch: `hub.cut[path] = n` cuts the next n GETs of that file: the headers promise the whole
body, half of it is sent, then the connection closes.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import unquote, urlsplit

Access = Literal["public", "private", "gated"]
LFS_THRESHOLD = 1 << 20  # files above this are LFS files on the Hub: sha256 oid and ETag


@dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    method: str
    path: str
    range: str | None
    token: str | None


@dataclass(kw_only=True, slots=True)
class Repo:
    access: Access = "public"
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes


def etag_of(data: bytes) -> str:
    """The ETag the Hub gives a file: sha256 for LFS files, the git blob id for the others."""
    if len(data) > LFS_THRESHOLD:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """`with FakeHub() as hub:` serves `hub.add(...)`-ed repositories at `hub.url` until the block ends."""

    TOKEN = "hf_local_test_token"  # the one token this Hub knows

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.cut: dict[str, int] = {}
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add(self, repo: str, files: dict[str, bytes], *, revision: str = "main", access: Access = "public") -> str:
        """Add `files` as a commit of `repo` that `revision` (a branch or tag) points at; its commit id."""
        commit = hashlib.sha1(
            repo.encode()
            + revision.encode()
            + b"".join(path.encode() + hashlib.sha1(data).digest() for path, data in sorted(files.items()))
        ).hexdigest()
        entry = self.repos.setdefault(repo, Repo(access=access))
        entry.refs[revision] = commit
        entry.commits[commit] = dict(files)
        return commit

    def requests(self, method: str | None = None, contains: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if (method is None or s.method == method) and contains in s.path]

    @property
    def url(self) -> str:
        assert self._server is not None, "the server is not running"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"hub": self}))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        try:
            self._server.shutdown()
        finally:
            self._server.server_close()
            self._thread.join(10)

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def _take_cut(self, path: str) -> bool:
        with self._lock:
            if self.cut.get(path, 0) <= 0:
                return False
            self.cut[path] -= 1
            return True


class _Refusal(Exception):
    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub  # set by FakeHub on the subclass it serves with
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx2 uses it; every answer has a Content-Length

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, *, body: bool) -> None:
        path = urlsplit(self.path).path
        auth = self.headers.get("Authorization")
        token = auth.removeprefix("Bearer ") if auth else None
        self.hub._record(Seen(method=self.command, path=path, range=self.headers.get("Range"), token=token))
        try:
            if token is not None and token != FakeHub.TOKEN:
                raise _Refusal(401, None, "Invalid credentials in Authorization header")
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                self._api(f"{unquote(parts[2])}/{unquote(parts[3])}", parts[4], unquote(parts[5]), token)
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo = f"{unquote(parts[0])}/{unquote(parts[1])}"
                self._file(repo, unquote(parts[3]), unquote("/".join(parts[4:])), token, body=body)
            else:
                raise _Refusal(404, None, f"no such endpoint: {path}")
        except _Refusal as refusal:
            self._json(
                refusal.status,
                {"error": refusal.message},
                {"X-Error-Message": refusal.message} | ({"X-Error-Code": refusal.code} if refusal.code else {}),
                body=body,
            )

    def _repo(self, repo: str, token: str | None) -> Repo:
        entry = self.hub.repos.get(repo)
        if entry is None or (entry.access == "private" and token is None):
            # the Hub's answer to a caller without a token is the same for both: 401
            raise _Refusal(404 if token else 401, "RepoNotFound", "Repository not found")
        return entry

    def _commit(self, repo: str, entry: Repo, revision: str) -> str:
        if revision in entry.commits:
            return revision
        if revision in entry.refs:
            return entry.refs[revision]
        raise _Refusal(404, "RevisionNotFound", f"Invalid rev id: {revision} for {repo}")

    def _api(self, repo: str, kind: str, revision: str, token: str | None) -> None:
        entry = self._repo(repo, token)
        commit = self._commit(repo, entry, revision)
        files = entry.commits[commit]
        if kind == "revision":
            self._json(
                200,
                {
                    "id": repo,
                    "modelId": repo,
                    "sha": commit,
                    "private": entry.access == "private",
                    "gated": "auto" if entry.access == "gated" else False,
                    "disabled": False,
                    "tags": [],
                    "siblings": [{"rfilename": p} for p in files],
                },
            )
            return
        tree = []
        for file_path, data in files.items():
            item = {
                "type": "file",
                "path": file_path,
                "size": len(data),
                "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
            }
            if len(data) > LFS_THRESHOLD:
                item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            tree.append(item)
        self._json(200, tree)

    def _file(self, repo: str, revision: str, file_path: str, token: str | None, *, body: bool) -> None:
        entry = self._repo(repo, token)
        if entry.access == "gated":
            raise _Refusal(
                403 if token else 401,
                "GatedRepo",
                f"Access to model {repo} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in.",
            )
        commit = self._commit(repo, entry, revision)
        data = entry.commits[commit].get(file_path)
        if data is None:
            raise _Refusal(404, "EntryNotFound", f"{file_path} does not exist on {revision}")
        start, status = 0, 200
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{etag_of(data)}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        wanted = self.headers.get("Range")
        if wanted and body:
            start = int(wanted.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                raise _Refusal(416, None, f"range {wanted} beyond {len(data)} bytes")
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        part = data[start:]
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        if not body:
            return
        if self.hub._take_cut(file_path):  # promise the whole body, send half, hang up
            self.wfile.write(part[: len(part) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(part)

    def _json(self, status: int, data: object, headers: dict[str, str] | None = None, *, body: bool = True) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(raw)
