"""Task IR, pipeline layout and static orders (1F1B, interleaved, GPipe): strings, properties, literal orders."""

from collections import Counter

import pytest

from megatron.app.schedule import (
    SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    PipelineLayout,
    ScheduleError,
    Task,
    TaskKind,
    build_schedule,
    format_schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    parse_schedule,
    validate_schedule,
)

F, B = TaskKind.FORWARD, TaskKind.BACKWARD


def _valid_combos():
    for pp_size in range(1, 7):
        for num_chunks in range(1, 4):
            for num_microbatches in range(1, 3 * pp_size + 2):
                for name in SCHEDULES:
                    if name == "1f1b" and num_chunks > 1:
                        continue
                    zero_bubble = name in ZERO_BUBBLE_SCHEDULES  # they follow the interleaved order
                    if (name == "interleaved" or zero_bubble) and num_chunks > 1 and num_microbatches % pp_size:
                        continue
                    yield name, PipelineLayout(pp_size, num_chunks, num_microbatches, split_backward=zero_bubble)


# ------------------------------------------------------------------------------------------- Task


@pytest.mark.parametrize("text, task", [
    ("F1.3", Task(F, 1, 3)),
    ("B0.2", Task(B, 0, 2)),
    ("F12.105", Task(F, 12, 105)),
])
def test_task_string_round_trip(text, task):
    assert str(task) == text
    assert Task.parse(text) == task
    assert Task.parse(str(task)) == task


def test_task_accepts_kind_letters_and_orders():
    assert Task("F", 1, 3) == Task(F, 1, 3)
    assert Task("F", 1, 3).kind is F
    assert sorted([Task(F, 1, 0), Task(B, 0, 1), Task(F, 0, 2)]) == [Task(B, 0, 1), Task(F, 0, 2), Task(F, 1, 0)]
    assert len({Task(F, 0, 0), Task.parse("F0.0")}) == 1


@pytest.mark.parametrize("text", ["X1.2", "F1", "f1.2", "F-1.2", "F1.2.3", "", "F 1.2"])
def test_task_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match=r"cannot parse task .*expected <F\|B\|I\|W><chunk>\.<microbatch>, e\.g\. 'F1\.3'"):
        Task.parse(text)


def test_task_rejects_bad_fields():
    with pytest.raises(ValueError, match="task kind must be 'F', 'B', 'I' or 'W', got 'X'"):
        Task("X", 0, 0)
    with pytest.raises(ValueError, match="must be >= 0, got chunk=-1 microbatch=0"):
        Task(F, -1, 0)


def test_schedule_string_round_trip():
    for name, layout in _valid_combos():
        for rank in range(layout.pp_size):
            order = build_schedule(name, layout, rank)
            assert parse_schedule(format_schedule(order)) == order


def test_parse_schedule_accepts_commas_and_names_bad_token():
    assert parse_schedule(" F0.0, B0.0\nF0.1 ") == [Task(F, 0, 0), Task(B, 0, 0), Task(F, 0, 1)]
    assert parse_schedule("") == []
    with pytest.raises(ValueError, match=r"schedule token 2: cannot parse task 'G0\.1'"):
        parse_schedule("F0.0 B0.0 G0.1")


# ----------------------------------------------------------------------------------------- layout


def test_layout_virtual_stages():
    layout = PipelineLayout(pp_size=4, num_chunks=2, num_microbatches=8)
    assert layout.num_virtual_stages == 8
    assert layout.virtual_stage(pp_rank=1, chunk=1) == 5
    for stage in range(8):
        assert layout.virtual_stage(*layout.rank_and_chunk(stage)) == stage
    assert layout.is_first_stage(0, 0) and not layout.is_first_stage(0, 1)
    assert layout.is_last_stage(3, 1) and not layout.is_last_stage(3, 0)


def test_layout_sources_and_destinations():
    layout = PipelineLayout(pp_size=4, num_chunks=2, num_microbatches=8)
    assert layout.input_source(0, Task(F, 0, 5)) is None  # reads data
    assert layout.input_source(0, Task(F, 1, 5)) == (3, 0)  # wraps around the ring
    assert layout.input_source(2, Task(F, 0, 5)) == (1, 0)
    assert layout.input_source(3, Task(B, 1, 5)) is None  # starts from the loss
    assert layout.input_source(3, Task(B, 0, 5)) == (0, 1)
    assert layout.output_destination(3, Task(F, 0, 5)) == (0, 1)
    assert layout.output_destination(3, Task(F, 1, 5)) is None
    assert layout.output_destination(0, Task(B, 1, 5)) == (3, 0)
    assert layout.output_destination(0, Task(B, 0, 5)) is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(pp_size=0, num_chunks=1, num_microbatches=4), "pp_size must be a positive integer, got 0"),
    (dict(pp_size=2, num_chunks=1, num_microbatches=-3), "num_microbatches must be a positive integer, got -3"),
])
def test_layout_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        PipelineLayout(**kwargs)


def test_layout_rejects_out_of_range_rank_and_chunk():
    layout = PipelineLayout(2, 2, 4)
    with pytest.raises(ScheduleError, match="pp_rank 2 out of range: pp_size is 2"):
        build_schedule("interleaved", layout, 2)
    with pytest.raises(ScheduleError, match="chunk 2 out of range: this layout has num_chunks=2"):
        layout.virtual_stage(0, 2)
    with pytest.raises(ScheduleError, match=r"virtual stage 4 out of range: pp_size\(2\) x num_chunks\(2\) = 4"):
        layout.rank_and_chunk(4)


# ---------------------------------------------------------------------------------------- orders


def test_every_order_runs_each_task_once_forward_before_backward():
    checked = 0
    for name, layout in _valid_combos():
        for rank in range(layout.pp_size):
            order = build_schedule(name, layout, rank)
            counts = Counter(order)
            assert set(counts) == set(layout.tasks()), (name, layout, rank)
            assert max(counts.values()) == 1, (name, layout, rank)
            position = {task: index for index, task in enumerate(order)}
            for task in order:
                if task.prerequisite is not None:  # B or I after its F, W after its I
                    assert position[task.prerequisite] < position[task], (name, layout, rank, task)
            validate_schedule(layout, rank, order)
            checked += 1
    assert checked > 500


def test_one_f_one_b_pp4_literal():
    layout = PipelineLayout(pp_size=4, num_chunks=1, num_microbatches=8)
    assert format_schedule(one_f_one_b(layout, 0)) == (
        "F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 F0.5 B0.2 F0.6 B0.3 F0.7 B0.4 B0.5 B0.6 B0.7"
    )
    assert format_schedule(one_f_one_b(layout, 3)) == (
        "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 F0.4 B0.4 F0.5 B0.5 F0.6 B0.6 F0.7 B0.7"
    )


def test_one_f_one_b_fewer_microbatches_than_stages():
    layout = PipelineLayout(pp_size=4, num_chunks=1, num_microbatches=2)
    assert format_schedule(one_f_one_b(layout, 0)) == "F0.0 F0.1 B0.0 B0.1"
    assert format_schedule(one_f_one_b(layout, 2)) == "F0.0 F0.1 B0.0 B0.1"
    assert format_schedule(one_f_one_b(layout, 3)) == "F0.0 B0.0 F0.1 B0.1"


def test_interleaved_pp2_chunks2_literal():
    # Forwards go in groups of pp_size=2 microbatches per chunk: F0.0 F0.1 F1.0 F1.1 F0.2 F0.3 F1.2 F1.3;
    # backwards the same with chunks reversed: B1.0 B1.1 B0.0 B0.1 B1.2 B1.3 B0.2 B0.3.
    # Warmup: rank 0 (2-0-1)*2 + (2-1)*2 = 4 forwards, rank 1 (2-1-1)*2 + 2 = 2 forwards.
    layout = PipelineLayout(pp_size=2, num_chunks=2, num_microbatches=4)
    assert format_schedule(interleaved_one_f_one_b(layout, 0)) == (
        "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3"
    )
    assert format_schedule(interleaved_one_f_one_b(layout, 1)) == (
        "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3"
    )


@pytest.mark.parametrize("pp_size, num_chunks, num_microbatches", [(4, 2, 8), (4, 3, 4), (2, 4, 6), (8, 2, 8)])
def test_interleaved_warmup_count_and_reversed_backward_chunks(pp_size, num_chunks, num_microbatches):
    layout = PipelineLayout(pp_size, num_chunks, num_microbatches)
    total = num_chunks * num_microbatches
    for rank in range(pp_size):
        order = interleaved_one_f_one_b(layout, rank)
        warmup = min((pp_size - rank - 1) * 2 + (num_chunks - 1) * pp_size, total)
        leading_forwards = next(i for i, task in enumerate(order) if task.kind is B)
        assert leading_forwards == min(warmup + 1, total)  # warmup, then the first steady forward
        assert order[leading_forwards] == Task(B, num_chunks - 1, 0)


def test_interleaved_with_one_chunk_is_one_f_one_b():
    layout = PipelineLayout(4, 1, 6)
    assert all(interleaved_one_f_one_b(layout, r) == one_f_one_b(layout, r) for r in range(4))


def test_gpipe_runs_all_forwards_then_all_backwards():
    layout = PipelineLayout(2, 2, 3)
    assert format_schedule(gpipe(layout, 1)) == (
        "F0.0 F0.1 F0.2 F1.0 F1.1 F1.2 B1.0 B1.1 B1.2 B0.0 B0.1 B0.2"
    )


def test_schedule_errors_name_the_numbers_and_the_fix():
    with pytest.raises(ScheduleError, match=(
        r"interleaved schedule needs num_microbatches \(6\) to be a multiple of pp_size \(4\): "
        r"use 4 or 8 microbatches, or num_chunks=1 with the '1f1b' schedule"
    )):
        build_schedule("interleaved", PipelineLayout(4, 2, 6), 0)
    with pytest.raises(ScheduleError, match=r"multiple of pp_size \(4\): use 4 microbatches"):
        build_schedule("interleaved", PipelineLayout(4, 2, 3), 0)
    with pytest.raises(ScheduleError, match=(
        "1f1b runs one model chunk per rank, but num_chunks=2: use the 'interleaved' schedule"
    )):
        build_schedule("1f1b", PipelineLayout(4, 2, 8), 0)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb': choose one of 1f1b, gpipe, interleaved"):
        build_schedule("zb", PipelineLayout(4, 1, 8), 0)


@pytest.mark.parametrize("text, message", [
    ("F0.0 F0.1 B0.0 B0.0 B0.1", "rank 0: task B0.0 appears twice"),
    ("F0.0 B0.1 F0.1 B0.0", r"rank 0: B0\.1 at position 1 runs before its forward F0\.1"),
    ("F0.0 F0.1 B0.0", r"rank 0: schedule is missing 1 task\(s\): B0\.1"),
    ("F0.0 F0.1 F1.0 B0.0 B0.1", r"task F1\.0 at position 2 is outside the layout \(num_chunks=1"),
])
def test_validate_schedule_rejects_broken_orders(text, message):
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(PipelineLayout(2, 1, 2), 0, parse_schedule(text))
