"""The report as one self-contained HTML file: the summary, the terms beside the plan, and the picture
(picture.py) as inline SVG. Nothing is fetched when it is viewed: no script, font or image from
elsewhere."""

from __future__ import annotations

from html import escape
from typing import Any

from tessera.profiling.picture import COLOURS, Scene

_STYLE = ("body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse}"
          "td,th{padding:2px 10px;text-align:right}td:first-child,th:first-child{text-align:left}"
          "pre{background:#f4f4f4;padding:.6em}.key span{display:inline-block;width:12px;height:12px;margin:0 4px}")


def svg(picture: Scene) -> str:
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{picture.width}" height="{picture.height}" '
             f'viewBox="0 0 {picture.width} {picture.height}">',
             f'<rect x="0" y="0" width="{picture.width}" height="{picture.height}" fill="#ffffff"/>']
    for b in picture.boxes:
        parts.append(f'<rect x="{b.x:.1f}" y="{b.y:.1f}" width="{b.w:.1f}" height="{b.h:.1f}" fill="{b.colour}">'
                     f'<title>{escape(b.title)}</title></rect>')
    for t in picture.texts:
        parts.append(f'<text x="{t.x:.1f}" y="{t.y:.1f}" font-size="12">{escape(t.text)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _terms_table(report: dict[str, Any], key: str = "terms", head: str = "term") -> str:
    rows = [f"<tr><th>{head}</th><th>measured s/step</th><th>planned s/step</th></tr>"]
    for name, v in report.get(key, {}).items():
        planned = "-" if v["planned_s"] is None else f"{v['planned_s']:.4f}"
        measured = "-" if v["measured_s"] is None else f"{v['measured_s']:.4f}"
        rows.append(f"<tr><td>{escape(name)}</td><td>{measured}</td><td>{planned}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def html_page(report: dict[str, Any], text: str, picture: Scene, title: str = "tessera profile") -> str:
    """The page: `text` (training.summary), the table of terms, the key of colours and the SVG."""
    key = "".join(f'<span style="background:{c}"></span>{escape(k)}' for k, c in COLOURS.items()
                  if k in ("compute", "exposed_comm", "pipeline_bubble", "data_wait", "optimizer", "checkpoint",
                           "idle", "planned"))
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>\n<h1>{escape(title)}</h1>\n<pre>{escape(text)}</pre>\n"
            f"{_terms_table(report)}\n{_terms_table(report, 'compute_by_kind', 'compute by kind')}\n"
            f"<p class=\"key\">{key}</p>\n{svg(picture)}\n</body></html>\n")
