"""Does an accelab report render, offline, into something a person would look at?

Builds `accelab report --last N` from a results store (or takes an existing HTML file; a built
one lives in a temporary directory and is removed afterwards), opens it
in headless Chromium with networking turned off, writes a screenshot and asserts the page is not
blank: the screenshot must hold many distinct colours (the plots) and not be mostly one colour.

    python benchmarks/report_screenshot.py [--db results.db] [--last 5] [--html r.html]
                                           [--out benchmarks/results/report_screenshot.png]

Needs `chromium` (Debian: apt-get install -y chromium) on PATH.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

# Distinct colours a page of text alone reaches (antialiased text gives a few hundred); the
# report's plots push it into the thousands.
MIN_COLOURS = 1000
MAX_SHARE_OF_ONE_COLOUR = 0.97


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("chromium is not installed: apt-get install -y chromium")


def screenshot(html: Path, png: Path, *, width: int = 1280, height: int = 2400, timeout_s: float = 120) -> Path:
    """Render `html` headless with every network feature off; write `png`."""
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={png.resolve()}",
            f"--window-size={width},{height}",
            html.resolve().as_uri(),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return png


def colour_stats(png: Path) -> tuple[int, float]:
    """(distinct colours, share of the most common colour) of an image."""
    from PIL import Image

    with Image.open(png) as img:
        rgb = img.convert("RGB")
        colours = rgb.getcolors(maxcolors=rgb.width * rgb.height)
    assert colours is not None
    top = max(count for count, _ in colours)
    return len(colours), top / (rgb.width * rgb.height)


def assert_not_blank(png: Path) -> tuple[int, float]:
    distinct, share = colour_stats(png)
    if distinct < MIN_COLOURS or share > MAX_SHARE_OF_ONE_COLOUR:
        raise AssertionError(
            f"{png} looks blank: {distinct} distinct colours (want >= {MIN_COLOURS}), "
            f"{share:.0%} of pixels one colour (want <= {MAX_SHARE_OF_ONE_COLOUR:.0%})"
        )
    return distinct, share


def build_report(db: Path | None, last: int, out: Path) -> Path:
    """`accelab report --last N --out FILE`, through the command's own register() (so this runs
    whether or not cli.py lists the report module yet)."""
    import typer

    from accelab.report.commands import register

    app = typer.Typer()
    register(app)
    args = ["report", "--last", str(last), "--out", str(out)] + (["--db", str(db)] if db else [])
    app(args, standalone_mode=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", type=Path, help="results store (default: accelab's)")
    parser.add_argument("--last", type=int, default=5)
    parser.add_argument("--html", type=Path, help="screenshot this report instead of building one")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "report_screenshot.png")
    parser.add_argument("--height", type=int, default=2400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        html = args.html or build_report(args.db, args.last, Path(scratch) / "report.html")
        png = screenshot(html, args.out, height=args.height)
    distinct, share = assert_not_blank(png)
    print(f"{png}: {distinct} distinct colours, {share:.0%} background — the report rendered offline")


if __name__ == "__main__":
    main()
