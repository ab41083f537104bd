"""Write a self-contained HTML report: sections of text, tables and matplotlib figures embedded as PNG."""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Section:
    title: str
    text: str = ""
    figure: Any = None  # a matplotlib Figure
    table: list[list[Any]] | None = None  # first row = header
    note: str = ""


@dataclass
class Report:
    title: str
    subtitle: str = ""
    sections: list[Section] = field(default_factory=list)

    def add(self, *args: Any, **kwargs: Any) -> Section:
        s = Section(*args, **kwargs)
        self.sections.append(s)
        return s

    def to_html(self) -> str:
        parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>",
                 "<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
                 "h1{margin-bottom:.2em}section{margin:2em 0;padding-top:1em;border-top:1px solid #ddd}"
                 "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}"
                 "th{background:#f3f3f3}img{max-width:100%}.note{color:#666;font-size:.9em}"
                 "pre{background:#f7f7f7;padding:.8em;white-space:pre-wrap}</style></head><body>",
                 f"<h1>{html.escape(self.title)}</h1><p>{html.escape(self.subtitle)}</p>"]
        for s in self.sections:
            parts.append(f"<section><h2>{html.escape(s.title)}</h2>")
            if s.text:
                parts.append(f"<pre>{html.escape(s.text)}</pre>" if "\n" in s.text else f"<p>{html.escape(s.text)}</p>")
            if s.table:
                head, *rows = s.table
                parts.append("<table><tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in head) + "</tr>")
                for r in rows:
                    parts.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>")
                parts.append("</table>")
            if s.figure is not None:
                parts.append(f"<img alt='{html.escape(s.title)}' src='data:image/png;base64,{_png(s.figure)}'>")
            if s.note:
                parts.append(f"<p class='note'>{html.escape(s.note)}</p>")
            parts.append("</section>")
        parts.append("</body></html>")
        return "\n".join(parts)

    def write(self, path: str | Path) -> Path:
        from waferline.files import write_text_atomic

        return write_text_atomic(path, self.to_html())


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")
