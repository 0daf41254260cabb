"""MegaScan II: find the slow GPU. Stateless analyzers (compute peers, collective arrival, P2P),
a combiner, what-if estimates and reports; `run_detection(DIR)` is the facade the CLI uses."""
from __future__ import annotations

import os

from megatron.scan.detect.combine import Detection, Suspect, detect
from megatron.scan.detect.model import DetectionInput, from_aggregation

__all__ = ["Detection", "DetectionInput", "Suspect", "detect", "from_aggregation", "run_detection"]


def run_detection(directory: str | os.PathLike, *, jobs: int | None = None, run_id: str | None = None,
                  what_if: bool = True) -> Detection:
    """Load, match and align a trace directory, then detect; raises AggregateError on bad input."""
    from megatron.scan.aggregate import aggregate

    aggregation = aggregate(directory, None, jobs=jobs, run_id=run_id)
    detection = detect(from_aggregation(aggregation))
    if what_if and detection.suspects:
        from megatron.scan.detect.whatif import estimate_all

        estimate_all(detection)
    return detection
