"""Chrome trace of a simulated pipeline (chrome://tracing, Perfetto): one process per rank, a slice
per task, a stored-activation counter per rank and an arrow per P2P message."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from megatron.app.schedule import TaskKind
from megatron.app.simulator_model import SimulationResult

_CATEGORY = {TaskKind.FORWARD: "forward", TaskKind.BACKWARD: "backward", TaskKind.INPUT_GRAD: "input gradient",
             TaskKind.WEIGHT_GRAD: "weight gradient"}


def to_chrome_trace(result: SimulationResult, *, flows: bool = True) -> dict[str, Any]:
    """Chrome trace (chrome://tracing, Perfetto): one process per rank, one "X" slice per task, a
    stored-activation counter per rank and, with `flows`, an arrow per P2P message."""
    layout = result.layout
    to_us = 1000.0  # simulator times are ms; Chrome trace timestamps are microseconds
    events: list[dict[str, Any]] = []
    for rank in range(layout.pp_size):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"pp rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    memory_changes: list[tuple[float, int, int]] = []
    for record in result.records:
        task = record.task
        events.append({
            "name": str(task),
            "cat": _CATEGORY[task.kind],
            "ph": "X",
            "pid": record.rank,
            "tid": 0,
            "ts": record.start * to_us,
            "dur": (record.end - record.start) * to_us,
            "args": {
                "chunk": task.chunk,
                "microbatch": task.microbatch,
                "virtual_stage": layout.virtual_stage(record.rank, task.chunk),
            },
        })
        if task.is_forward:
            memory_changes.append((record.start, record.rank, +1))
        elif task.frees_activation:
            memory_changes.append((record.end, record.rank, -1))
    stored = [0] * layout.pp_size
    for time, rank, change in sorted(memory_changes):
        stored[rank] += change
        events.append({"ph": "C", "name": "stored activations", "pid": rank, "tid": 0, "ts": time * to_us,
                       "args": {"count": stored[rank]}})
    if flows:
        starts = {(record.rank, record.task): record for record in result.records}
        for flow_id, transfer in enumerate(result.transfers):
            producer = starts[(transfer.src_rank, transfer.src_task)]
            consumer = starts[(transfer.dst_rank, transfer.dst_task)]
            name = "activation" if transfer.src_task.is_forward else "gradient"
            # The start point sits inside the producer slice so the viewer binds the arrow to it.
            events.append({"ph": "s", "id": flow_id, "name": name, "cat": "p2p", "pid": transfer.src_rank, "tid": 0,
                           "ts": (producer.start + producer.end) / 2 * to_us})
            events.append({"ph": "f", "bp": "e", "id": flow_id, "name": name, "cat": "p2p", "pid": transfer.dst_rank,
                           "tid": 0, "ts": consumer.start * to_us})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "pp_size": layout.pp_size,
            "num_chunks": layout.num_chunks,
            "num_microbatches": layout.num_microbatches,
            "makespan_ms": result.makespan,
        },
    }


def write_chrome_trace(result: SimulationResult, path: str | os.PathLike[str], *, flows: bool = True) -> None:
    """Write the Chrome trace atomically: a reader never sees a half-written file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(to_chrome_trace(result, flows=flows), stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
