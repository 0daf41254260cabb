"""MegaScan II: find the slow GPU. Stateless analyzers (compute peers, collective arrival, P2P),
a combiner, what-if estimates and reports; `run_detection(DIR)` is the facade the CLI uses."""
from __future__ import annotations

import os

from megatron.scan.detect.combine import Detection, detect
from megatron.scan.detect.suspect import Suspect
from megatron.scan.detect.model import DetectionInput, from_aggregation

__all__ = ["Detection", "DetectionInput", "Suspect", "detect", "from_aggregation", "run_detection"]


def run_detection(directory: str | os.PathLike, *, jobs: int | None = None, run_id: str | None = None,
                  what_if: bool = True, progress=None, aggregation=None) -> Detection:
    """Load, match and align a trace directory, then detect; raises AggregateError on bad input.
    `progress`: a megatron.app.progress.Reporter for each step's progress line (default: silent).
    `aggregation`: the directory's aggregation when the caller already made it (the merged trace's
    writer: `scripts/aggregate.py -d` aggregates once)."""
    from megatron.app.progress import SILENT
    from megatron.scan.aggregate import aggregate

    progress = progress or SILENT
    if aggregation is None:
        aggregation = aggregate(directory, None, jobs=jobs, run_id=run_id, progress=progress)
    with progress.step("building per-rank tables"):
        data = from_aggregation(aggregation)
    detection = detect(data, progress=progress)
    if what_if and detection.suspects:
        from megatron.scan.detect.whatif import estimate_all

        estimate_all(detection, progress=progress)
    return detection
