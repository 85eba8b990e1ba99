"""HTML building blocks of the report: number formatting, escaping, notes, tables, sections, the style sheet and
the render-check script."""

from __future__ import annotations

import html
import math

from holotrain.profile.report.data import _num

esc = html.escape


def _fmt(v, digits: int = 3) -> str:
    """A number for people: 3 significant digits, thousands separators, '—' for nothing."""
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    v = _num(v)
    if v is None:
        return "—"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:,.{max(0, digits - 1 - math.floor(math.log10(a)))}f}"
    return f"{v:.{digits}g}"


def _pct(v) -> str:
    v = _num(v)
    return "—" if v is None else f"{v * 100:.1f}%"


def _code(text: str) -> str:
    """Escape text, then show `backticked` parts as <code>."""
    parts = esc(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def _note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def _table(rows: list[tuple[str, str]], cls: str = "kv") -> str:
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="{cls}">{body}</table>'


def _section(title: str, body: str, sid: str) -> str:
    return f'<section id="{sid}"><h2>{esc(title)}</h2>{body}</section>'


def _figs(*svgs: str) -> str:
    return '<div class="charts">' + "".join(f"<figure>{s}</figure>" for s in svgs if s) + "</div>"


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1240px;
 color:#222;padding:0 12px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
.sub{color:#666;margin:0 0 12px}
table{border-collapse:collapse;margin:6px 0}th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;
 vertical-align:top}th{font-weight:600;color:#444}
table.kv th{width:220px}table.samples th{width:90px}table.samples td{white-space:pre-wrap;font-family:monospace}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.charts{display:flex;flex-wrap:wrap;gap:16px}figure{margin:0}
svg.chart{background:#fff;max-width:100%;height:auto}svg text{font:11px sans-serif;fill:#333}
svg text.title{font:bold 13px sans-serif}svg text.axis{fill:#555}svg text.small{font-size:10px;fill:#666}
.note{color:#777;font-style:italic;margin:4px 0}
.bar{display:inline-block;height:10px;background:#1f77b4;vertical-align:middle;margin-right:6px}
.nowrap{white-space:nowrap}code{background:#f3f3f3;padding:0 3px;border-radius:3px}
#render-check{display:none}
"""

# Records, for each chart, its rendered box and how many data marks it draws with a non-empty box.
SCRIPT = """
(function(){var out=[];document.querySelectorAll('svg.chart').forEach(function(s){var r=s.getBoundingClientRect();
var n=0;s.querySelectorAll('.mark').forEach(function(m){var b=m.getBBox();if(b.width>0||b.height>0)n++;});
var rec={id:s.id,x:Math.round(r.left+window.scrollX),y:Math.round(r.top+window.scrollY),w:Math.round(r.width),
h:Math.round(r.height),marks:n};s.setAttribute('data-rendered',JSON.stringify(rec));out.push(rec);});
document.getElementById('render-check').textContent=JSON.stringify(out);})();
"""
