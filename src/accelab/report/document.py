"""The report as data: sections of cards, tables, figures and notes. Pure: the HTML and markdown
renderers (`render.py`) and the plotting (`plots.py`) read it; nothing here draws or writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Tone = Literal["", "good", "warn", "bad", "muted", "id"]  # id: a run id / fingerprint, never wrapped
ChartKind = Literal["latency_cdf", "batch_curve", "pareto", "load_curve", "train_curves"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Cell:
    text: str
    tone: Tone = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Table:
    columns: list[str]
    rows: list[list[Cell]]
    caption: str = ""
    numeric: frozenset[int] = frozenset()  # column indices aligned right


@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    name: str  # file-name slug, unique in the document: "latency-1"
    chart: ChartKind
    data: Any  # the series object(s) `plots.draw` expects for this chart
    caption: str
    alt: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Note:
    text: str
    tone: Tone = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cards:
    items: list[tuple[str, str]]  # (value, label)


@dataclass(frozen=True, kw_only=True, slots=True)
class Facts:
    title: str
    items: list[tuple[str, str]]  # (label, value)


Block = Cell | Table | Figure | Note | Cards | Facts


@dataclass(kw_only=True, slots=True)
class Section:
    id: str  # HTML anchor
    title: str
    intro: str = ""
    blocks: list[Block] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class Document:
    title: str
    subtitle: str
    sections: list[Section]
    skipped: list[str] = field(default_factory=list)  # "Training curves: no train runs selected"

    def figures(self) -> list[Figure]:
        return [b for s in self.sections for b in s.blocks if isinstance(b, Figure)]


def cell(text: Any, tone: Tone = "") -> Cell:
    return Cell(text="-" if text is None else str(text), tone=tone)
