"""A report Document as ONE self-contained HTML file (inline CSS, PNGs as base64 data URIs, no
script, font or link that needs a network), or as markdown with its PNGs written beside it.

`to_html` / `to_markdown` are pure given `png` (Figure -> bytes); `write_report` is the only
function here that touches files, and picks the format from the file's extension.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from pathlib import Path

from accelab.report.document import Cards, Document, Facts, Figure, Note, Section, Table

PngFn = Callable[[Figure], bytes]
HTML_SUFFIXES = (".html", ".htm")
MARKDOWN_SUFFIXES = (".md", ".markdown")

CSS = """
:root{--ink:#111827;--muted:#6b7280;--line:#e5e7eb;--bg:#f8fafc;--card:#fff;--accent:#2563eb;
--good:#15803d;--good-bg:#dcfce7;--warn:#a16207;--warn-bg:#fef9c3;--bad:#b91c1c;--bad-bg:#fee2e2}
*{box-sizing:border-box}
body{margin:0;font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
color:var(--ink);background:var(--bg)}
header{background:#0f172a;color:#f8fafc;padding:28px 40px 18px}
header h1{margin:0 0 4px;font-size:24px;font-weight:650}
header .sub{margin:0 0 14px;color:#cbd5e1}
nav a{color:#bfdbfe;text-decoration:none;margin-right:16px;font-size:13px;white-space:nowrap}
nav a:hover{text-decoration:underline}
main{max-width:1200px;margin:0 auto;padding:8px 40px 40px}
section{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:18px 22px;margin:22px 0;
box-shadow:0 1px 2px rgba(15,23,42,.04)}
h2{margin:0 0 6px;font-size:18px}
h3{margin:14px 0 6px;font-size:14px;color:#334155}
.intro{color:var(--muted);margin:0 0 12px}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin:8px 0 16px}
.card{flex:1 1 160px;border:1px solid var(--line);border-radius:8px;padding:10px 14px;background:#f8fafc}
.card .value{font-size:24px;font-weight:700;color:var(--accent)}
.card .label{color:var(--muted);font-size:12px}
.table-wrap{overflow-x:auto;margin:10px 0 16px}
table{border-collapse:collapse;width:100%;font-size:13px}
caption{text-align:left;font-weight:600;padding:4px 0 8px;color:#334155}
th{text-align:left;background:#f1f5f9;color:#334155;font-weight:600;border-bottom:2px solid var(--line);
padding:6px 10px;white-space:nowrap}
td{border-bottom:1px solid var(--line);padding:6px 10px;vertical-align:top;word-break:break-word}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tbody tr:nth-child(even){background:#fafafa}
.good{color:var(--good);font-weight:600}.warn{color:var(--warn);font-weight:600}.bad{color:var(--bad);font-weight:700}
.muted{color:var(--muted)}
.id{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;white-space:nowrap;color:#475569}
p.note{padding:8px 12px;border-radius:6px;background:#f1f5f9;margin:8px 0}
p.note.good{background:var(--good-bg)}p.note.warn{background:var(--warn-bg)}p.note.bad{background:var(--bad-bg)}
p.note.muted{font-weight:400}
figure{margin:14px 0 20px}
figure img{display:block;max-width:100%;height:auto;border:1px solid var(--line);border-radius:6px}
figcaption{color:var(--muted);font-size:12.5px;margin-top:6px}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:3px 18px;margin:6px 0 14px}
dl.facts dt{color:var(--muted)}dl.facts dd{margin:0;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
footer{color:var(--muted);text-align:center;font-size:12px;padding:0 0 30px}
"""


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _table_html(t: Table) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in t.columns)
    body = []
    for row in t.rows:
        cells = []
        for i, c in enumerate(row):
            classes = " ".join(filter(None, ["num" if i in t.numeric else "", c.tone]))
            attr = f' class="{classes}"' if classes else ""
            cells.append(f"<td{attr}>{_e(c.text)}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    caption = f"<caption>{_e(t.caption)}</caption>" if t.caption else ""
    return (
        f'<div class="table-wrap"><table>{caption}<thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _block_html(block: object, png: PngFn) -> str:
    if isinstance(block, Table):
        return _table_html(block)
    if isinstance(block, Figure):
        data = base64.b64encode(png(block)).decode("ascii")
        return (
            f'<figure id="fig-{_e(block.name)}"><img src="data:image/png;base64,{data}" alt="{_e(block.alt)}">'
            f"<figcaption>{_e(block.caption)}</figcaption></figure>"
        )
    if isinstance(block, Note):
        return f'<p class="note {block.tone}">{_e(block.text)}</p>'
    if isinstance(block, Cards):
        cards = "".join(
            f'<div class="card"><div class="value">{_e(v)}</div><div class="label">{_e(k)}</div></div>'
            for v, k in block.items
        )
        return f'<div class="cards">{cards}</div>'
    if isinstance(block, Facts):
        items = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in block.items)
        return f'<h3>{_e(block.title)}</h3><dl class="facts">{items}</dl>'
    raise TypeError(f"unknown report block {type(block).__name__}")


def _section_html(section: Section, png: PngFn) -> str:
    intro = f'<p class="intro">{_e(section.intro)}</p>' if section.intro else ""
    blocks = "\n".join(_block_html(b, png) for b in section.blocks)
    return f'<section id="{_e(section.id)}"><h2>{_e(section.title)}</h2>{intro}\n{blocks}</section>'


def to_html(doc: Document, png: PngFn) -> str:
    nav = "".join(f'<a href="#{_e(s.id)}">{_e(s.title)}</a>' for s in doc.sections)
    sections = "\n".join(_section_html(s, png) for s in doc.sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(doc.title)}</title><style>{CSS}</style></head>\n<body>"
        f'<header><h1>{_e(doc.title)}</h1><p class="sub">{_e(doc.subtitle)}</p><nav>{nav}</nav></header>\n'
        f"<main>\n{sections}\n</main>"
        "<footer>accelab report · one self-contained file: figures are embedded, nothing is fetched</footer>"
        "</body></html>\n"
    )


# -- markdown ----------------------------------------------------------------------------------
def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table_md(t: Table) -> str:
    lines = [f"**{_md(t.caption)}**", ""] if t.caption else []
    lines.append("| " + " | ".join(_md(c) for c in t.columns) + " |")
    lines.append("|" + "".join("---:|" if i in t.numeric else "---|" for i in range(len(t.columns))))
    for row in t.rows:
        lines.append("| " + " | ".join(_md(c.text) if c.tone != "bad" else f"**{_md(c.text)}**" for c in row) + " |")
    return "\n".join(lines)


def to_markdown(doc: Document, image_path: Callable[[Figure], str]) -> str:
    """`image_path(figure)` gives the (relative) path the figure's PNG is written to."""
    out = [f"# {doc.title}", "", f"_{doc.subtitle}_", ""]
    for section in doc.sections:
        out += [f"## {section.title}", ""]
        if section.intro:
            out += [section.intro, ""]
        for block in section.blocks:
            if isinstance(block, Table):
                out.append(_table_md(block))
            elif isinstance(block, Figure):
                out += [f"![{_md(block.alt)}]({image_path(block)})", "", f"*{block.caption}*"]
            elif isinstance(block, Note):
                label = {"bad": "**regression:** ", "warn": "**warning:** "}.get(block.tone, "")
                out.append(f"> {label}{block.text}")
            elif isinstance(block, Cards):
                out.append(" · ".join(f"**{v}** {k}" for v, k in block.items))
            elif isinstance(block, Facts):
                out += [f"### {block.title}", "", "| | |", "|---|---|"]
                out += [f"| {_md(k)} | {_md(v)} |" for k, v in block.items]
            out.append("")
    return "\n".join(out)


def write_report(doc: Document, out: Path, png: PngFn) -> list[Path]:
    """Write the report; returns every file written (the report first)."""
    suffix = out.suffix.lower()
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix in HTML_SUFFIXES:
        out.write_text(to_html(doc, png), encoding="utf-8")
        return [out]
    if suffix in MARKDOWN_SUFFIXES:
        written = []

        def image_path(figure: Figure) -> str:
            path = out.with_name(f"{out.stem}-{figure.name}.png")
            path.write_bytes(png(figure))
            written.append(path)
            return path.name

        out.write_text(to_markdown(doc, image_path), encoding="utf-8")
        return [out, *written]
    raise ValueError(
        f"--out {out} has extension {suffix or '(none)'!r}; use .html (one self-contained file) "
        "or .md (markdown with PNGs beside it)"
    )
