"""Quantities with units as people type them on the command line: memory sizes ("2GiB"),
durations ("30s", "10m"), percentages ("5%") and per-request latency objectives
("ttft=500ms,e2e=2s"). Pure. Every error names the option, the value and the forms accepted.

Each option keeps the units it always accepted (`--budget` has no milliseconds, an SLO no
hours): the caller names them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_NUMBER = r"(\d+\.?\d*|\.\d+)"  # 2, 2.5, 2., .5
_QUANTITY = re.compile(rf"^\s*{_NUMBER}\s*([a-z]*)\s*$", re.I)

# MiB per unit: sizes are reported in MiB (`peak_memory_mb`); kB/MB/GB/TB are decimal
SIZE_UNITS_MIB: dict[str, float] = {
    "b": 1 / 2**20,
    "kb": 1e3 / 2**20,
    "kib": 1 / 1024,
    "mb": 1e6 / 2**20,
    "mib": 1.0,
    "gb": 1e9 / 2**20,
    "gib": 1024.0,
    "tb": 1e12 / 2**20,
    "tib": float(2**20),
}
SIZE_SPELLINGS = "B, kB, KiB, MB, MiB, GB, GiB, TB, TiB"
DURATION_UNITS_S: dict[str, float] = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def _quantity(text: str) -> tuple[float, str] | None:
    """'2GiB' -> (2.0, 'gib'); None when it is not a number followed by letters."""
    match = _QUANTITY.match(str(text))
    return (float(match[1]), match[2].lower()) if match else None


def parse_size_mib(text: str, option: str = "--max-memory") -> float:
    """'2GiB', '1500MB', '800MiB' -> MiB. A bare number is refused: 2000 what?"""
    found = _quantity(text)
    if found is None or (found[1] and found[1] not in SIZE_UNITS_MIB):
        raise ValueError(f"{option} {text!r} must be a size like 2GiB or 1500MB (units: {SIZE_SPELLINGS})")
    value, unit = found
    if not unit:
        raise ValueError(f"{option} {text!r} needs a unit: e.g. {text.strip()}MiB or {text.strip()}GiB")
    return value * SIZE_UNITS_MIB[unit]


def parse_duration_s(
    text: str, option: str = "--budget", *, units: Iterable[str] = ("s", "m", "h"), bare: str | None = "s"
) -> float:
    """'90s', '10m', '1h' -> seconds, in the `units` this option accepts; a bare number is in
    `bare` units (None: a bare number is refused)."""
    allowed = tuple(units)
    found = _quantity(text)
    unit = (found[1] or bare) if found else None
    if found is None or unit not in allowed:
        examples = ", ".join(f"{n}{u}" for n, u in zip((500, 30, 10, 2, 7, 2), DURATION_UNITS_S) if u in allowed)
        plain = f"; a bare number is {bare}" if bare else ""
        raise ValueError(f"{option} {text!r} must be a duration like {examples} (units: {', '.join(allowed)}{plain})")
    return found[0] * DURATION_UNITS_S[unit]


def parse_percent(text: str, option: str = "--threshold") -> float:
    """'5%' or '5' -> 0.05."""
    raw = str(text).strip().removesuffix("%").strip()
    try:
        value = float(raw) / 100
    except ValueError:
        raise ValueError(f"{option} {text!r} is not a percentage; give e.g. {option} 5%") from None
    if not 0 <= value < 100:
        raise ValueError(f"{option} {text!r} is out of range; give a percentage >= 0, e.g. {option} 5%")
    return value


def parse_objectives(text: str | None, keys: Iterable[str], option: str = "--slo") -> dict[str, float]:
    """'ttft=500ms,e2e=2s' -> {'ttft': 0.5, 'e2e': 2.0}: seconds by key; a bare number is seconds.
    Keys are case-insensitive and must be among `keys`."""
    allowed = tuple(keys)
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in allowed:
            raise ValueError(
                f"{option} part {part!r} must look like KEY=TIME with KEY one of {', '.join(allowed)}, "
                f"e.g. {option} ttft=500ms,e2e=2s"
            )
        try:
            values[key] = parse_duration_s(raw, f"{option} {key}=", units=("ms", "s"))
        except ValueError:
            raise ValueError(f"{option} {key}={raw!r}: give a time such as 500ms, 2s or 0.5 (seconds)") from None
    return values
