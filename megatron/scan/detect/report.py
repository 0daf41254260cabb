"""Detection outputs: DIR/abnormal.json (machine-readable), DIR/abnormal.txt (`<rank> <dp>-<pp>-<tp>`
per suspect rank, the seed's format) and a short human-readable report."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatron.scan.detect.combine import Detection, json_friendly
from megatron.scan.detect.power import verdict_lines

FORMAT = "megascan-abnormal"
VERSION = 1


def as_dict(detection: Detection) -> dict[str, Any]:
    data = detection.data
    suspects = []
    for s in detection.suspects:
        entry = {"kind": s.kind, "ranks": s.ranks, "coordinates": [data.roles[r].coordinates for r in s.ranks],
                 "confidence": s.confidence, "slowdown": json_friendly(s.slowdown), "evidence": s.evidence,
                 "named_by": s.named_by, "what_if": json_friendly(s.what_if), "details": s.details}
        suspects.append(entry)
    return {
        "format": FORMAT, "version": VERSION, "verdict": detection.verdict,
        "sizes": data.sizes, "ranks": data.world,
        "suspects": suspects,
        "power": detection.power.as_dict() if detection.power is not None else None,
        "leading_candidate": detection.leading,
        "stages": {
            "compute": {"noise": json_friendly(detection.compute.noise),
                        "cannot_compare": detection.compute.cannot_compare,
                        "ranks": {str(r): json_friendly(f) for r, f in sorted(detection.compute.findings.items())}},
            "arrival": {"instances": detection.arrival.instances,
                        "ranks": {str(r): json_friendly(f) for r, f in sorted(detection.arrival.findings.items())}},
            "pipeline": {"links": [json_friendly(link) for link in detection.pipeline.links.values()],
                         "producer_wait_ms": json_friendly(detection.pipeline.producer_wait_ms),
                         "receive_wait_ms": json_friendly(detection.pipeline.receive_wait_ms)},
            "host": {"noise": json_friendly(detection.host.noise),
                     "ranks": {str(r): json_friendly(f) for r, f in sorted(detection.host.findings.items())}},
        },
        "notes": detection.notes,
    }


def suspect_ranks(detection: Detection) -> list[int]:
    """Ranks named as slow, a slow node's ranks included (link suspects are in abnormal.json
    only: a link is not a GPU)."""
    seen: list[int] = []
    for s in detection.suspects:
        if s.kind in ("rank", "node"):
            seen.extend(r for r in s.ranks if r not in seen)
    return seen


def text_report(detection: Detection) -> str:
    data = detection.data
    sizes = data.sizes
    lines = [f"MegaScan detection: {len(data.world)} ranks (DP={sizes.get('dp')} PP={sizes.get('pp')} "
             f"TP={sizes.get('tp')}), verdict: {detection.verdict}"]
    if not detection.suspects:
        lines.append("no suspect: no rank is significantly slower than its peers, no link is slow"
                     if detection.verdict == "healthy" else "no suspect could be named")
    lines.extend(f"{line}" for line in verdict_lines(detection))
    for i, s in enumerate(detection.suspects, 1):
        what = s.describe(data)
        factor = f"{s.slowdown:.2f}x" if s.slowdown == s.slowdown else "slowdown not measurable"
        lines.append(f"{i}. {what}: confidence {s.confidence:.2f}, {factor}")
        lines.extend(f"     - {e}" for e in s.evidence)
        if s.what_if:
            lines.append(f"     - what-if: iteration {s.what_if['measured_ms']:.1f} ms -> {s.what_if['healthy_ms']:.1f} ms "
                         f"if healthy; this {s.kind} costs the job {s.what_if['cost_percent']:.1f}%")
    for note in detection.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def write_outputs(detection: Detection, directory: str | os.PathLike, *, html: bool = True) -> dict[str, Path]:
    """abnormal.json, abnormal.txt, detection.txt (and report.html) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"json": directory / "abnormal.json", "txt": directory / "abnormal.txt",
             "report": directory / "detection.txt"}
    _atomic_write(paths["json"], json.dumps(as_dict(detection), indent=1))
    roles = detection.data.roles
    _atomic_write(paths["txt"], "".join(f"{r} {roles[r].coordinates}\n" for r in suspect_ranks(detection)))
    _atomic_write(paths["report"], text_report(detection) + "\n")
    if html:
        from megatron.scan.detect.html import write_html

        paths["html"] = write_html(detection, directory / "report.html")
    return paths


def _atomic_write(path: Path, text: str) -> None:
    # Readers (a dashboard, a scheduler draining nodes) never see half a file.
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
