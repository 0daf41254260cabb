"""Aggregation facade: load all ranks -> match collectives and P2P -> align clocks -> emit one
Chrome trace. Each step is its own module; this file only chains them and summarizes."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron.app.progress import SILENT, Reporter
from megatron.scan.align import Alignment, align
from megatron.scan.chrome import write_chrome_trace
from megatron.scan.load import GlobalTrace, load_directory
from megatron.scan.match import Collectives, P2PLinks, match_collectives, match_p2p


@dataclass(kw_only=True)
class Aggregation:
    trace: GlobalTrace
    collectives: Collectives
    p2p: P2PLinks
    alignment: Alignment
    timings: dict[str, float] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)  # what the trace writer wrote (events, flows, ...)

    def summary(self) -> dict[str, Any]:
        col = self.collectives
        spread = collective_end_spread_us(self.trace, col)
        return {
            "run_id": self.trace.run_id,
            "ranks": sorted(self.trace.ranks),
            "events": len(self.trace),
            "collective_instances": len(col),
            "collective_instances_incomplete": int((~col.complete).sum()),
            "collective_op_mismatches": int(col.op_mismatch.sum()),
            "p2p_links": len(self.p2p),
            "p2p_unmatched_sends": len(self.p2p.unmatched_sends),
            "p2p_unmatched_recvs": len(self.p2p.unmatched_recvs),
            "collective_end_spread_us_median": round(float(np.median(spread)), 3) if len(spread) else None,
            "collective_end_spread_us_p95": round(float(np.percentile(spread, 95)), 3) if len(spread) else None,
            "alignment": self.alignment.as_dict(),
            "warnings": self.trace.warnings,
            "seconds": {k: round(v, 3) for k, v in self.timings.items()},
        }


def collective_end_spread_us(trace: GlobalTrace, collectives: Collectives) -> np.ndarray:
    """Per complete synchronous instance: latest minus earliest finish across participants, µs."""
    rows = np.flatnonzero(collectives.row_instance >= 0)
    if not len(rows):
        return np.zeros(0)
    inst = collectives.row_instance[rows]
    end = trace.columns["end"][rows]
    count = len(collectives)
    high = np.full(count, np.iinfo(np.int64).min, dtype=np.int64)
    low = np.full(count, np.iinfo(np.int64).max, dtype=np.int64)
    np.maximum.at(high, inst, end)
    np.minimum.at(low, inst, end)
    keep = collectives.complete & collectives.synchronous & (collectives.members >= 2)
    return (high[keep] - low[keep]) / 1e3


def aggregate(directory: str | os.PathLike, output: str | os.PathLike | None = None, *, jobs: int | None = None,
              run_id: str | None = None, allow_drift: bool = True, do_align: bool = True,
              fitted: dict[tuple[int, int], tuple[float, float]] | None = None,
              progress: Reporter = SILENT, trace_format: str = "chrome") -> Aggregation:
    """Run the whole pipeline; writes the trace to `output` when given (`trace_format` "chrome":
    Chrome JSON, "perfetto": Perfetto protobuf). `fitted`: clock
    corrections of windows aligned before (see align), reused instead of fitted again. `progress`
    reports each step on stderr (the CLIs pass one; silent by default)."""
    timings: dict[str, float] = {}
    started = time.perf_counter()
    trace = load_directory(directory, jobs=jobs, run_id=run_id, progress=progress)
    timings["load"] = time.perf_counter() - started
    mark = time.perf_counter()
    with progress.step("matching collectives and P2P messages", 2) as step:
        collectives = match_collectives(trace)
        step.update()
        p2p = match_p2p(trace)
        step.update()
    timings["match"] = time.perf_counter() - mark
    mark = time.perf_counter()
    if do_align:
        with progress.step("aligning clocks", 0, unit=" solver steps") as step:
            alignment = align(trace, collectives, p2p, allow_drift=allow_drift, fitted=fitted, progress=step)
    else:
        alignment = Alignment(ranks={}, model={}, anchors=0, unanchored=sorted(trace.ranks))
    timings["align"] = time.perf_counter() - mark
    result = Aggregation(trace=trace, collectives=collectives, p2p=p2p, alignment=alignment, timings=timings)
    if output is not None:
        result.written = write_trace(result, output, trace_format, progress=progress)
    timings["total"] = time.perf_counter() - started
    return result


def write_trace(result: Aggregation, output: str | os.PathLike, trace_format: str = "chrome", *,
                progress: Reporter = SILENT) -> dict[str, int]:
    """Write the merged trace as Chrome JSON or Perfetto protobuf; times it as timings["emit"]."""
    mark = time.perf_counter()
    writer = write_chrome_trace
    if trace_format == "perfetto":
        from megatron.scan.perfetto import write_perfetto_trace as writer
    elif trace_format != "chrome":
        raise ValueError(f"unknown trace format {trace_format!r}: chrome or perfetto")
    counts = writer(result.trace, result.collectives, result.p2p, output, other_data={"megascan": result.summary()},
                    progress=progress)
    result.timings["emit"] = time.perf_counter() - mark
    return counts
