"""DIR/report.html: one self-contained page (inline CSS, no scripts, no network) with a rank x
op-type slowness heatmap, per-rank iteration-time bars, and the suspects with evidence and what-if."""
from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from megatron.scan.detect.combine import Detection
from megatron.scan.detect.compute_stats import busy_medians
from megatron.scan.detect.power import verdict_lines
from megatron.scan.detect.typical import group_median


def _color(ratio: float) -> str:
    """1.0 -> white, >= 2.0 -> full red, <= 0.5 -> full blue."""
    if ratio != ratio:
        return "#eeeeee"
    x = float(np.clip(np.log2(max(ratio, 1e-6)), -1.0, 1.0))
    if x >= 0:
        other = int(255 * (1 - x))
        return f"#ff{other:02x}{other:02x}"
    other = int(255 * (1 + x))
    return f"#{other:02x}{other:02x}ff"


def _heatmap(detection: Detection) -> str:
    """Per rank and op type: median busy time relative to the median of its stage's rows (those
    rank 0 holds: every rank's, or the reference ranks' when the nodes reduced theirs). Every
    rank's and every stage's median at once (a loop over ranks of masks over every row took 87 s
    of the report of a 4,096-rank job)."""
    data = detection.data
    t = data.compute
    ops = [("forward", 0), ("backward", 1)]
    stage_ids: dict = {}
    size = max(max(data.world, default=0), int(t["rank"].max()) if len(t["rank"]) else 0) + 1
    stage_of = np.full(size, -1, dtype=np.int64)
    for rank in data.world:
        stage_of[rank] = stage_ids.setdefault(data.roles[rank].stage, len(stage_ids))
    rank, kind = t["rank"].astype(np.int64), t["kind"].astype(np.int64)
    keep = np.isin(kind, [k for _, k in ops]) & (stage_of[rank] >= 0)
    busy = t["busy"][keep].astype(np.float64)
    rank, kind = rank[keep], kind[keep]
    own = np.full(size * 2, np.nan)  # [rank * 2 + kind] median busy
    for (r, k), ns in busy_medians(data).items():
        if r < size:
            own[r * 2 + k] = ns
    stages = np.full(max(len(stage_ids), 1) * 2, np.nan)  # [stage * 2 + kind] median busy of its ranks' rows
    groups, medians = group_median(busy, stage_of[rank] * 2 + kind)
    stages[groups] = medians
    rows = []
    for rank in data.world:
        cells = []
        for name, kind in ops:
            ratio = float(own[rank * 2 + kind] / stages[stage_of[rank] * 2 + kind])
            cells.append(f'<td style="background:{_color(ratio)}">{ratio:.2f}x</td>' if ratio == ratio else "<td>-</td>")
        arrival = detection.arrival.findings.get(rank)
        ratio = arrival.last / arrival.expected_last if arrival and arrival.expected_last else float("nan")
        cells.append(f'<td style="background:{_color(ratio)}">{ratio:.2f}x</td>' if ratio == ratio else "<td>-</td>")
        rows.append(f"<tr><th>{html.escape(data.label(rank))}</th>{''.join(cells)}</tr>")
    head = "".join(f"<th>{n} busy / stage median</th>" for n, _ in ops) + "<th>last arrivals / chance</th>"
    return f"<table class=heat><tr><th>rank</th>{head}</tr>{''.join(rows)}</table>"


def _iteration_bars(detection: Detection) -> str:
    it = detection.data.iteration_time
    if not len(it["rank"]):
        return "<p>no iteration spans</p>"
    durations = (it["end"] - it["start"]) / 1e6
    top = float(durations.max()) or 1.0
    rows = []
    for i in np.unique(it["iteration"]):
        mine = it["iteration"] == i
        span = float((it["end"][mine].max() - it["start"][mine].min()) / 1e6)
        width = 100.0 * min(span / top, 1.0)
        rows.append(f'<tr><th>iteration {int(i)}</th><td><div class=bar style="width:{width:.1f}%"></div></td>'
                    f"<td>{span:.1f} ms</td></tr>")
    return f"<table class=bars>{''.join(rows)}</table>"


def _suspects(detection: Detection) -> str:
    if not detection.suspects:
        more = "".join(f"<p>{html.escape(line)}</p>" for line in verdict_lines(detection))
        return f"<p>No suspect (verdict: {html.escape(detection.verdict)}).</p>{more}"
    items = []
    data = detection.data
    for s in detection.suspects:
        title = html.escape(s.describe(data)).replace(" -&gt; ", " &rarr; ")
        evidence = "".join(f"<li>{html.escape(e)}</li>" for e in s.evidence)
        what_if = ""
        if s.what_if:
            what_if = (f"<li><b>what-if</b>: {s.what_if['measured_ms']:.1f} ms &rarr; {s.what_if['healthy_ms']:.1f} ms "
                       f"per iteration if healthy: it costs the job {s.what_if['cost_percent']:.1f}%</li>")
        factor = f"{s.slowdown:.2f}x" if s.slowdown == s.slowdown else "slowdown not measurable"
        items.append(f"<li><b>{title}</b> confidence {s.confidence:.2f}, "
                     f"{factor}<ul>{evidence}{what_if}</ul></li>")
    return f"<ol>{''.join(items)}</ol>"


def render(detection: Detection) -> str:
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in detection.notes)
    sizes = detection.data.sizes
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>MegaScan detection</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:3px 8px;text-align:left}}.bar{{background:#4a7;height:12px}}.bars td:nth-child(2){{width:400px}}</style>
</head><body><h1>MegaScan detection</h1>
<p>{len(detection.data.world)} ranks, DP={sizes.get('dp')} PP={sizes.get('pp')} TP={sizes.get('tp')};
verdict: <b>{html.escape(detection.verdict)}</b></p>
<h2>Suspects</h2>{_suspects(detection)}
<h2>Slowness heatmap</h2><p>White = like its peers, red = slower, blue = faster.</p>{_heatmap(detection)}
<h2>Iteration time</h2>{_iteration_bars(detection)}
<h2>Notes</h2><ul>{notes}</ul></body></html>
"""


def write_html(detection: Detection, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render(detection))
    return path
