"""The tracer in one process: which iterations are traced, what a window holds, sequence numbers
counted outside windows, megatron-core's bound aliases of collectives wrapped, and the writer."""
from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from launch import free_port
from megatron.scan.collectives import is_wrapper
from megatron.scan.timers import HostTimer
from megatron.scan.trace_format import (ClockSkew, TraceFormatError, TraceWriter, decode_column, encode_column,
                                        header_fields, read_rank_file)
from megatron.scan.tracer import Tracer, WindowSchedule


@pytest.mark.parametrize("interval, continuous, traced, ends", [
    (5, 2, [0, 1, 5, 6, 10], [1, 6]),
    (1, 1, [0, 1, 2, 3], list(range(8))),
    (4, 4, [0, 1, 2, 3, 4], [3, 7]),
])
def test_window_schedule(interval, continuous, traced, ends):
    schedule = WindowSchedule(interval, continuous)
    assert [i for i in range(11) if schedule.is_traced(i)][:len(traced)] == traced
    assert [i for i in range(8) if schedule.is_window_end(i)] == ends


def test_a_dense_start_traces_every_one_of_the_first_iterations_in_windows_of_the_interval():
    """The default start: every one of the first 20 iterations (20 to compare, not 8), then 2 in 5."""
    schedule = WindowSchedule(5, 2, dense_until=12)
    assert [i for i in range(30) if schedule.is_traced(i)] == [*range(12), 15, 16, 20, 21, 25, 26]
    assert [i for i in range(30) if schedule.is_window_end(i)] == [4, 9, 11, 16, 21, 26]
    resumed = WindowSchedule(5, 2, dense_until=1000 + 20)  # resumed at iteration 1000: its own first 20
    assert [i for i in range(1000, 1030) if resumed.is_traced(i)] == [*range(1000, 1020), 1020, 1021, 1025, 1026]


@pytest.fixture
def world(tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_tracer(path, schedule=WindowSchedule(2, 1), skew=None) -> Tracer:
    header = header_fields(rank=0, world_size=1, run_id="unit", coordinates={"dp": 0, "pp": 0, "tp": 0},
                           sizes={"dp": 1, "pp": 1, "tp": 1})
    return Tracer(writer=TraceWriter(path, header, skew=skew), timer=HostTimer(), schedule=schedule)


def test_window_contents_and_sequence_numbers(world, tmp_path):
    from megatron.core.tensor_parallel import mappings

    path = tmp_path / "rank0.json"
    tracer = make_tracer(path)
    tracer.collectives.install()
    try:
        assert is_wrapper(mappings.dist_all_gather_func)
        group = dist.new_group([0], group_desc="UNIT_GROUP")
        for iteration in range(4):
            tracer.begin_iteration(iteration)
            with tracer.span("iteration", iteration=iteration):
                with tracer.span("forward", chunk=0, microbatch=3):
                    dist.all_reduce(torch.ones(8), group=group)
                    mappings.dist_all_gather_func(torch.zeros(4), torch.ones(4), group=group)
                with tracer.span("send", peer=1, bytes=64, chunk=0, microbatch=3, direction="B"):
                    pass
            tracer.end_iteration(iteration, {"iteration_time": 0.1, "lm loss": 2.0})
        tracer.close({"reason": "test"})
    finally:
        tracer.collectives.uninstall()
    assert not is_wrapper(dist.all_reduce)
    f = read_rank_file(path)
    assert f.ended and [w["iterations"] for w in f.windows] == [[0, 0], [2, 2]]
    names = [f.names[i] for i in f.columns["name"]]
    assert names.count("all_reduce") == 2 and names.count("all_gather_into_tensor") == 2
    rows = [i for i, n in enumerate(names) if n in ("all_reduce", "all_gather_into_tensor")]
    # Counted in untraced iteration 1 too: iteration 2's calls are numbers 4 and 5 of the group.
    assert [int(f.columns["seq"][i]) for i in rows] == [0, 1, 4, 5]
    assert {int(f.columns["microbatch"][i]) for i in rows} == {3}  # context of the enclosing forward
    assert f.groups[f.columns["group"][rows[0]]]["desc"] == "UNIT_GROUP"
    assert int(f.columns["bytes"][rows[0]]) == 32 and f.names[f.columns["dtype"][rows[0]]] == "float32"
    send = names.index("send")
    assert int(f.columns["peer"][send]) == 1 and int(f.columns["flags"][send]) & 1
    metrics = f.windows[0]["metrics"]
    assert [{k: m[k] for k in ("iteration", "iteration_time", "loss")} for m in metrics] == \
        [{"iteration": 0, "iteration_time": 0.1, "loss": 2.0}]
    # The host counters of the iteration: CPU time used and time spent waiting for a CPU.
    assert metrics[0]["cpu_ms"] > 0 and metrics[0]["cpu_wait_ms"] >= 0
    # Spans nest: forward inside iteration.
    i, fw = names.index("iteration"), names.index("forward")
    assert f.columns["start_ns"][i] <= f.columns["start_ns"][fw] <= f.columns["end_ns"][fw] <= f.columns["end_ns"][i]


def test_a_diverged_loss_written_as_nan_reads_back(tmp_path):
    """The writer keeps a NaN or infinite loss (JSON's NaN / Infinity literals); the fast parser
    refuses them, so the reader falls back to the standard one for those lines."""
    path = tmp_path / "r.json"
    tracer = make_tracer(path, WindowSchedule(1, 1))
    for iteration, loss in enumerate([2.5, float("nan"), float("inf")]):
        tracer.begin_iteration(iteration)
        with tracer.span("iteration", iteration=iteration):
            pass
        tracer.end_iteration(iteration, {"iteration_time": 0.1, "lm loss": loss})
    tracer.close({})
    assert b"NaN" in path.read_bytes() and b"Infinity" in path.read_bytes()
    f = read_rank_file(path)
    assert f.ended and not f.warnings and [w["iterations"] for w in f.windows] == [[0, 0], [1, 1], [2, 2]]
    first, second, third = (w["metrics"][0]["loss"] for w in f.windows)
    assert first == 2.5 and math.isnan(second) and third == math.inf
    assert [f.names[i] for i in f.columns["name"]] == ["iteration"] * 3


@pytest.mark.parametrize("values, code", [
    ([], "i1"), ([-128, 0, 127], "i1"), ([128], "i2"), ([-32768, 32767], "i2"), ([-32769], "i4"),
    ([2**31 - 1, -(2**31)], "i4"), ([2**31], "i8"), ([-(2**63), 2**63 - 1], "i8"),
])
def test_an_event_column_is_stored_in_the_narrowest_type_that_holds_it(values, code):
    stored = encode_column(values)
    assert stored.startswith(code + ":")
    back = decode_column(stored)
    assert back.dtype == np.int64 and back.tolist() == values
    assert decode_column(values).tolist() == values  # a version-1 JSON array reads the same


def traced_file(path, iterations=3):
    tracer = make_tracer(path, WindowSchedule(1, 1))
    for iteration in range(iterations):
        tracer.begin_iteration(iteration)
        with tracer.span("iteration", iteration=iteration):
            with tracer.span("forward", chunk=0, microbatch=0):
                pass
        tracer.end_iteration(iteration, {"iteration_time": 0.1, "lm loss": 2.0})
    tracer.close({})
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_version_1_file_with_json_array_columns_reads_as_the_same_events(tmp_path):
    """Files written before the columns were encoded (version 1: JSON arrays) read as they did."""
    lines = traced_file(tmp_path / "new.json")
    assert lines[0]["version"] == 2 and all(isinstance(v, str) for v in lines[1]["events"].values())
    lines[0]["version"] = 1
    for line in lines[1:-1]:
        line["events"] = {column: decode_column(stored).tolist() for column, stored in line["events"].items()}
    (tmp_path / "old.json").write_text("".join(json.dumps(line) + "\n" for line in lines))
    new, old = read_rank_file(tmp_path / "new.json"), read_rank_file(tmp_path / "old.json")
    assert not old.warnings and len(old.windows) == len(new.windows) == 3
    assert old.columns.keys() == new.columns.keys()
    for column, values in new.columns.items():
        assert np.array_equal(old.columns[column], values), column
    assert [new.names[i] for i in new.columns["name"]] == ["forward", "iteration"] * 3


@pytest.mark.parametrize("column, stored, why", [
    ("flags", "u4:AAAAAA==", "encoded as 'u4'"),
    ("flags", "i4:not base64!", "Only base64 data is allowed"),
    ("flags", "i4:" + base64.b64encode(b"abc").decode(), "not whole i4 values"),
    ("flags", "i1:" + base64.b64encode(b"\0").decode(), "a column of 1 values in a window of 2 events"),
    ("flags", 7, "stored as int"),
])
def test_a_malformed_event_column_names_the_file_and_line(tmp_path, column, stored, why):
    path = tmp_path / "r.json"
    lines = traced_file(path)
    lines[1]["events"][column] = stored  # the first window, with later ones after it: not a torn last line
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(TraceFormatError) as error:
        read_rank_file(path)
    assert f"{path}: line 2 is not a valid window record" in str(error.value) and why in str(error.value)


def test_untraced_iterations_record_nothing(tmp_path):
    tracer = make_tracer(tmp_path / "r.json", WindowSchedule(3, 1))
    tracer.begin_iteration(1)
    assert not tracer.active
    with tracer.span("forward", chunk=0, microbatch=0):
        pass
    assert tracer.events == []
    tracer.close({})


def test_clock_skew_shifts_wall_and_stretches_monotonic(tmp_path):
    skew = ClockSkew(offset_ns=5_000_000, drift=1e-3, reference_ns=0)
    assert skew.wall(10) == 5_000_010 and skew.mono(1_000_000) == 1_001_000
    tracer = make_tracer(tmp_path / "r.json", WindowSchedule(1, 1), skew=skew)
    tracer.close({})
    header = json.loads((tmp_path / "r.json").read_text().splitlines()[0])
    assert header["clock_reference"]["wall_ns"] > 0


def test_waiting_on_an_async_collective_is_recorded(world, tmp_path):
    """megatron-core's backward issues the TP all-reduce async and waits on it later; that wait is
    time spent on peers, recorded as a `collective_wait` span so detection does not count it as work."""
    path = tmp_path / "async.json"
    tracer = make_tracer(path, WindowSchedule(1, 1))
    tracer.collectives.install()
    try:
        tracer.begin_iteration(0)
        with tracer.span("backward", chunk=0, microbatch=2):
            handle = dist.all_reduce(torch.ones(8), async_op=True)
            handle.wait()
            assert handle.is_completed()  # the rest of the handle is the original's
        tracer.end_iteration(0, {"iteration_time": 0.1})
        untraced = dist.all_reduce(torch.ones(8), async_op=True)  # outside a window: not wrapped
        untraced.wait()
        tracer.close({"reason": "test"})
    finally:
        tracer.collectives.uninstall()
    f = read_rank_file(path)
    names = [f.names[i] for i in f.columns["name"]]
    assert names.count("collective_wait") == 1
    wait, backward = names.index("collective_wait"), names.index("backward")
    assert int(f.columns["microbatch"][wait]) == 2 and int(f.columns["group"][wait]) == -1
    assert f.columns["start_ns"][backward] <= f.columns["start_ns"][wait] <= f.columns["end_ns"][wait] \
        <= f.columns["end_ns"][backward]


def test_watchdog_and_metrics_observers_receive_collectives_and_hangs_through_the_spine(world, tmp_path):
    """The plugins subscribe to the spine's observer, not to each other: a collective reaches the
    watchdog's and the metrics' observers, a hang the metrics' gauge, and a removed observer
    nothing more."""
    pytest.importorskip("prometheus_client")
    from megatron.app import observer as spine
    from megatron.scan.collectives import CollectiveObserver
    from megatron.scan.metrics import MetricsSpans, RankMetrics
    from megatron.scan.watchdog import Watchdog, WatchdogSpans, process_identity

    collectives = CollectiveObserver(lambda: 0, lambda *event: None)
    collectives.install()
    identity = process_identity(0, 1, {"dp": 0, "pp": 0, "tp": 0})
    watchdog = Watchdog(directory=tmp_path, identity=identity, timeout=60, observer=collectives)
    metrics = RankMetrics(identity)
    watched, measured = WatchdogSpans(watchdog), MetricsSpans(metrics)
    try:
        spine.set_observer(watched)
        spine.set_observer(measured)
        watchdog.last_progress -= 30
        dist.all_reduce(torch.ones(4))
        assert watchdog.stalled_seconds() < 5 and watchdog.last_progress_what == "all_reduce"
        assert metrics._collectives[("all_reduce", collectives.group_info(None).gid)]._count.get() == 1
        spine.hang(True)
        assert metrics.hang._value.get() == 1
        spine.remove_observer(measured)
        dist.all_reduce(torch.ones(4))
        assert metrics._collectives[("all_reduce", collectives.group_info(None).gid)]._count.get() == 1
    finally:
        spine.set_observer(None)
        collectives.uninstall()
