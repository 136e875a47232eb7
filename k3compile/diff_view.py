"""Pass diffs for people: unified text and a self-contained HTML page.

The HTML page needs no server and no network: one file with inline CSS and JS. Left: the passes
(with match counts). Right: the graph before and after the selected pass side by side, removed
lines red, added lines green, and each node's provenance (the captured nodes it stands for) shown
on hover.
"""

from __future__ import annotations

import difflib
import html
import json

from .pipeline import PassRecord


def text_report(records: list[PassRecord], only: str | None = None) -> str:
    out = []
    for r in records:
        if only and r.name != only:
            continue
        out.append(f"=== {r.summary()}")
        d = r.diff()
        out.append(d if d else "(no change)\n")
    return "\n".join(out)


def _side_by_side(rec: PassRecord) -> str:
    a, b = rec.before.splitlines(), rec.after.splitlines()
    pa = rec.before_provenance + [""] * (len(a) - len(rec.before_provenance))
    pb = rec.after_provenance + [""] * (len(b) - len(rec.after_provenance))
    rows = []

    def cell(text, prov, cls):
        title = f' title="{html.escape(prov)}"' if prov else ""
        return f'<td class="{cls}"{title}>{html.escape(text)}</td>' if text is not None else '<td class="empty"></td>'

    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                rows.append(f"<tr>{cell(a[i], pa[i], 'same')}{cell(b[j], pb[j], 'same')}</tr>")
            continue
        left = list(range(i1, i2))
        right = list(range(j1, j2))
        for k in range(max(len(left), len(right))):
            lc = cell(a[left[k]], pa[left[k]], "del") if k < len(left) else cell(None, "", "")
            rc = cell(b[right[k]], pb[right[k]], "add") if k < len(right) else cell(None, "", "")
            rows.append(f"<tr>{lc}{rc}</tr>")
    return "\n".join(rows)


_CSS = """
body{margin:0;font-family:system-ui,sans-serif;display:flex;height:100vh}
nav{width:300px;overflow:auto;border-right:1px solid #ccc;background:#f6f6f6}
nav h1{font-size:15px;margin:10px}
nav a{display:block;padding:6px 10px;color:#222;text-decoration:none;font-size:13px;border-bottom:1px solid #e4e4e4}
nav a.sel{background:#dde8ff}
nav a .m{color:#666;font-size:11px;display:block}
main{flex:1;overflow:auto}
section{display:none}section.sel{display:block}
h2{font-size:14px;margin:8px}
table{border-collapse:collapse;width:100%;table-layout:fixed;font-family:monospace;font-size:11px}
td{white-space:pre-wrap;word-break:break-all;vertical-align:top;padding:1px 4px;border-bottom:1px solid #f0f0f0}
td.del{background:#ffe0e0}td.add{background:#dcfadc}td.empty{background:#fafafa}
td[title]{cursor:help;text-decoration:underline dotted #999}
"""

_JS = """
function show(i){document.querySelectorAll('section').forEach((s,k)=>s.classList.toggle('sel',k==i));
document.querySelectorAll('nav a').forEach((a,k)=>a.classList.toggle('sel',k==i));}
document.addEventListener('DOMContentLoaded',()=>show(0));
"""


def html_report(records: list[PassRecord], title: str) -> str:
    nav, sections = [], []
    for k, r in enumerate(records):
        meta = "skipped: " + r.notes if not r.applied else (
            f"{r.match_count} matches, +{r.nodes_added}/-{r.nodes_removed} nodes, "
            f"{'changed' if r.changed else 'unchanged'}")
        nav.append(f'<a href="#p{k}" onclick="show({k});return false">{r.index:02d} {html.escape(r.name)}'
                   f'<span class="m">{html.escape(meta)}</span></a>')
        sections.append(
            f'<section id="p{k}" data-pass="{html.escape(r.name)}"><h2>{r.index:02d} {html.escape(r.name)} '
            f'({html.escape(r.stage)}) - {html.escape(meta)}</h2><table><colgroup><col><col></colgroup>'
            f'<tr><th>before</th><th>after</th></tr>{_side_by_side(r)}</table></section>')
    data = json.dumps([{"name": r.name, "matches": r.match_count, "changed": r.changed} for r in records])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>{_CSS}</style><script>{_JS}</script></head><body><nav><h1>{html.escape(title)}</h1>'
            f'{"".join(nav)}</nav><main>{"".join(sections)}</main>'
            f'<script type="application/json" id="k3-passes">{html.escape(data, quote=False)}</script>'
            f'</body></html>\n')
