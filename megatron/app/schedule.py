"""Pipeline schedules as data: the task IR (F|B|I|W, chunk, microbatch), the pipeline layout, and the
static orders (1F1B, interleaved 1F1B, GPipe, and the zero-bubble orders of
megatron.app.schedule_zero_bubble) that an executor or the simulator runs.

A backward B may be split (a layout with `split_backward`) into I, the gradient of the stage input
(what the previous stage waits for), and W, the gradients of the stage's weights from what I kept:
I runs where B would, W may run later, and together they compute what B computes, once.
Pure Python; no torch."""

from __future__ import annotations

import enum
import importlib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "TaskKind",
    "Task",
    "PipelineLayout",
    "ScheduleError",
    "SCHEDULES",
    "one_f_one_b",
    "interleaved_one_f_one_b",
    "gpipe",
    "ZERO_BUBBLE_SCHEDULES",
    "split_backwards",
    "build_schedule",
    "validate_schedule",
    "format_schedule",
    "parse_schedule",
]


class ScheduleError(ValueError):
    """A layout or order that no schedule can run; the message says which numbers and what to change."""


class TaskKind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    INPUT_GRAD = "I"  # the backward's stage-input gradient (sent upstream)
    WEIGHT_GRAD = "W"  # the backward's weight gradients, from what I kept

    def __str__(self) -> str:
        return self.value


_TASK_PATTERN = re.compile(r"([FBIW])(\d+)\.(\d+)")


@dataclass(frozen=True, slots=True, order=True)
class Task:
    """One unit of pipeline work on one rank: forward or backward of a local model chunk on a microbatch."""

    kind: TaskKind
    chunk: int  # local model-chunk index on this rank, 0..num_chunks-1
    microbatch: int

    def __post_init__(self) -> None:
        # Accept "F"/"B" so hand-written tasks read naturally; store the enum so equality is exact.
        try:
            object.__setattr__(self, "kind", TaskKind(self.kind))
        except ValueError:
            raise ValueError(f"task kind must be 'F', 'B', 'I' or 'W', got {self.kind!r}") from None
        if self.chunk < 0 or self.microbatch < 0:
            raise ValueError(f"task chunk and microbatch must be >= 0, got chunk={self.chunk} microbatch={self.microbatch}")

    def __str__(self) -> str:
        return f"{self.kind.value}{self.chunk}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Task":
        match = _TASK_PATTERN.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"cannot parse task {text!r}: expected <F|B|I|W><chunk>.<microbatch>, e.g. 'F1.3', 'B0.2' or 'W0.2'")
        kind, chunk, microbatch = match.groups()
        return cls(TaskKind(kind), int(chunk), int(microbatch))

    @property
    def is_forward(self) -> bool:
        return self.kind is TaskKind.FORWARD

    @property
    def takes_gradient(self) -> bool:
        """B or I: consumes the next stage's gradient and sends the stage input's gradient upstream."""
        return self.kind is TaskKind.BACKWARD or self.kind is TaskKind.INPUT_GRAD

    @property
    def frees_activation(self) -> bool:
        """B or W: the task after which nothing of the microbatch's forward is kept on this chunk."""
        return self.kind is TaskKind.BACKWARD or self.kind is TaskKind.WEIGHT_GRAD

    @property
    def message(self) -> str:
        """What a P2P message into or out of this task carries: "F" an activation, "B" a gradient
        (also I's), "" none (W neither receives nor sends)."""
        if self.kind is TaskKind.WEIGHT_GRAD:
            return ""
        return "F" if self.kind is TaskKind.FORWARD else "B"

    @property
    def prerequisite(self) -> "Task | None":
        """The task of this rank that must have completed before this one may start: a backward's
        (B, I) own forward, W's own I; None for a forward."""
        if self.kind is TaskKind.FORWARD:
            return None
        kind = TaskKind.INPUT_GRAD if self.kind is TaskKind.WEIGHT_GRAD else TaskKind.FORWARD
        return Task(kind, self.chunk, self.microbatch)


def forward(chunk: int, microbatch: int) -> Task:
    return Task(TaskKind.FORWARD, chunk, microbatch)


def backward(chunk: int, microbatch: int) -> Task:
    return Task(TaskKind.BACKWARD, chunk, microbatch)


def input_grad(chunk: int, microbatch: int) -> Task:
    return Task(TaskKind.INPUT_GRAD, chunk, microbatch)


def weight_grad(chunk: int, microbatch: int) -> Task:
    return Task(TaskKind.WEIGHT_GRAD, chunk, microbatch)


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """Which rank holds which model chunk: virtual stage v lives on rank v % pp_size as chunk v // pp_size.
    `split_backward`: each backward runs as I then W (see the module's docstring), not as one B."""

    pp_size: int
    num_chunks: int
    num_microbatches: int
    split_backward: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.split_backward, bool):
            raise ScheduleError(f"split_backward must be True or False, got {self.split_backward!r}")
        for name in ("pp_size", "num_chunks", "num_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{name} must be a positive integer, got {value!r}")

    @property
    def num_virtual_stages(self) -> int:
        return self.pp_size * self.num_chunks

    def virtual_stage(self, pp_rank: int, chunk: int) -> int:
        self._check_rank(pp_rank)
        if not 0 <= chunk < self.num_chunks:
            raise ScheduleError(f"chunk {chunk} out of range: this layout has num_chunks={self.num_chunks}")
        return chunk * self.pp_size + pp_rank

    def rank_and_chunk(self, virtual_stage: int) -> tuple[int, int]:
        if not 0 <= virtual_stage < self.num_virtual_stages:
            raise ScheduleError(
                f"virtual stage {virtual_stage} out of range: pp_size({self.pp_size}) x num_chunks({self.num_chunks})"
                f" = {self.num_virtual_stages} stages"
            )
        return virtual_stage % self.pp_size, virtual_stage // self.pp_size

    def is_first_stage(self, pp_rank: int, chunk: int) -> bool:
        return self.virtual_stage(pp_rank, chunk) == 0

    def is_last_stage(self, pp_rank: int, chunk: int) -> bool:
        return self.virtual_stage(pp_rank, chunk) == self.num_virtual_stages - 1

    def input_source(self, pp_rank: int, task: Task) -> tuple[int, int] | None:
        """(peer rank, peer chunk) whose output this task consumes; None when the input is local
        (data for the first stage's forward, the loss for the last stage's backward, I's output for W)."""
        stage = self.virtual_stage(pp_rank, task.chunk)
        if task.kind is TaskKind.WEIGHT_GRAD:
            return None
        peer = stage - 1 if task.is_forward else stage + 1
        if 0 <= peer < self.num_virtual_stages:
            return self.rank_and_chunk(peer)
        return None

    def output_destination(self, pp_rank: int, task: Task) -> tuple[int, int] | None:
        """(peer rank, peer chunk) that consumes this task's output; None when the output stays local
        (the last stage's forward feeds the loss, the first stage's backward ends the chain, W's
        gradients stay with the weights)."""
        stage = self.virtual_stage(pp_rank, task.chunk)
        if task.kind is TaskKind.WEIGHT_GRAD:
            return None
        peer = stage + 1 if task.is_forward else stage - 1
        if 0 <= peer < self.num_virtual_stages:
            return self.rank_and_chunk(peer)
        return None

    @property
    def backward_kinds(self) -> tuple[TaskKind, ...]:
        """What a backward runs as: (B,), or (I, W) with split_backward."""
        return (TaskKind.INPUT_GRAD, TaskKind.WEIGHT_GRAD) if self.split_backward else (TaskKind.BACKWARD,)

    def gradient_task(self, chunk: int, microbatch: int) -> Task:
        """The task that takes a (chunk, microbatch)'s output gradient: its B, or its I when split."""
        return Task(self.backward_kinds[0], chunk, microbatch)

    def tasks(self) -> Iterator[Task]:
        """Every task one rank runs in an iteration (the same set on each rank), in a canonical order."""
        for kind in (TaskKind.FORWARD, *self.backward_kinds):
            for chunk in range(self.num_chunks):
                for microbatch in range(self.num_microbatches):
                    yield Task(kind, chunk, microbatch)

    def _check_rank(self, pp_rank: int) -> None:
        if not 0 <= pp_rank < self.pp_size:
            raise ScheduleError(f"pp_rank {pp_rank} out of range: pp_size is {self.pp_size}")


def _steady_order(forwards: Sequence[Task], backwards: Sequence[Task], num_warmup: int) -> list[Task]:
    """Warmup forwards, then alternate one forward / one backward, then the remaining backwards."""
    num_warmup = min(num_warmup, len(forwards))
    order = list(forwards[:num_warmup])
    num_steady = len(forwards) - num_warmup
    for step in range(num_steady):
        order.append(forwards[num_warmup + step])
        order.append(backwards[step])
    order.extend(backwards[num_steady:])
    return order


def one_f_one_b(layout: PipelineLayout, pp_rank: int) -> list[Task]:
    """Non-interleaved 1F1B: rank r runs pp_size - r - 1 warmup forwards, so at most pp_size - r
    activations are stored at once."""
    layout._check_rank(pp_rank)
    if layout.num_chunks != 1:
        raise ScheduleError(
            f"1f1b runs one model chunk per rank, but num_chunks={layout.num_chunks}: "
            "use the 'interleaved' schedule for virtual pipeline stages, or set num_chunks=1"
        )
    microbatches = range(layout.num_microbatches)
    forwards = [forward(0, m) for m in microbatches]
    backwards = [backward(0, m) for m in microbatches]
    return split_backwards(layout, _steady_order(forwards, backwards, layout.pp_size - pp_rank - 1))


def split_backwards(layout: PipelineLayout, order: Sequence[Task]) -> list[Task]:
    """`order` for the layout: with split_backward each B becomes its I followed at once by its W
    (the same computation in the same order: what zero-bubble schedules are compared with)."""
    if not layout.split_backward:
        return list(order)
    result = []
    for task in order:
        if task.kind is TaskKind.BACKWARD:
            result += [input_grad(task.chunk, task.microbatch), weight_grad(task.chunk, task.microbatch)]
        else:
            result.append(task)
    return result


def _interleaved_sequence(layout: PipelineLayout, kind: TaskKind) -> list[Task]:
    # Microbatches go in groups of pp_size: a group passes through every chunk before the next group
    # starts, so each rank always has the next chunk's input arriving while it works on the current one.
    # Backward walks the chunks in reverse because gradients flow from the last virtual stage back.
    chunks = list(range(layout.num_chunks))
    if kind is TaskKind.BACKWARD:
        chunks.reverse()
    order = []
    for group_start in range(0, layout.num_microbatches, layout.pp_size):
        group = range(group_start, min(group_start + layout.pp_size, layout.num_microbatches))
        for chunk in chunks:
            order.extend(Task(kind, chunk, m) for m in group)
    return order


def interleaved_one_f_one_b(layout: PipelineLayout, pp_rank: int) -> list[Task]:
    """Interleaved 1F1B over num_chunks virtual stages per rank. With one chunk it is plain 1F1B."""
    layout._check_rank(pp_rank)
    if layout.num_chunks == 1:
        return one_f_one_b(layout, pp_rank)
    pp_size, num_microbatches = layout.pp_size, layout.num_microbatches
    if num_microbatches % pp_size != 0:
        lower = num_microbatches - num_microbatches % pp_size
        hint = f"{lower} or {lower + pp_size}" if lower else f"{pp_size}"
        raise ScheduleError(
            f"interleaved schedule needs num_microbatches ({num_microbatches}) to be a multiple of "
            f"pp_size ({pp_size}): use {hint} microbatches, or num_chunks=1 with the '1f1b' schedule"
        )
    forwards = _interleaved_sequence(layout, TaskKind.FORWARD)
    backwards = _interleaved_sequence(layout, TaskKind.BACKWARD)
    # Twice the 1F1B warmup because a rank's next input now comes around the whole ring of ranks,
    # plus one group per extra chunk so that the first backward's gradient can reach this rank.
    num_warmup = (pp_size - pp_rank - 1) * 2 + (layout.num_chunks - 1) * pp_size
    return split_backwards(layout, _steady_order(forwards, backwards, num_warmup))


def gpipe(layout: PipelineLayout, pp_rank: int) -> list[Task]:
    """All forwards (chunk by chunk), then all backwards (last chunk first); stores every activation."""
    layout._check_rank(pp_rank)
    microbatches = range(layout.num_microbatches)
    order = [forward(c, m) for c in range(layout.num_chunks) for m in microbatches]
    order += [backward(c, m) for c in reversed(range(layout.num_chunks)) for m in microbatches]
    return split_backwards(layout, order)


def _zero_bubble(name: str) -> Callable[[PipelineLayout, int], list[Task]]:
    def build(layout: PipelineLayout, pp_rank: int) -> list[Task]:
        # Those orders are found by simulating (schedule_zero_bubble -> simulator -> this module), a
        # layer above the IR: it is looked up by name when first used, as a plugin is, so that this
        # module does not import the simulator (tests/app/test_architecture.py: no import circle).
        return importlib.import_module("megatron.app.schedule_zero_bubble").build(name, layout, pp_rank)

    build.__name__ = name.replace("-", "_")
    return build


# Orders that run each backward as I and W, apart (they need a layout with split_backward).
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zb-h2")

SCHEDULES: dict[str, Callable[[PipelineLayout, int], list[Task]]] = {
    "1f1b": one_f_one_b,
    "interleaved": interleaved_one_f_one_b,
    "gpipe": gpipe,
    **{name: _zero_bubble(name) for name in ZERO_BUBBLE_SCHEDULES},
}


def build_schedule(name: str, layout: PipelineLayout, pp_rank: int) -> list[Task]:
    """The static order `name` (a key of SCHEDULES) for one rank."""
    builder = SCHEDULES.get(name)
    if builder is None:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(sorted(SCHEDULES))}")
    return builder(layout, pp_rank)


def validate_schedule(layout: PipelineLayout, pp_rank: int, tasks: Sequence[Task]) -> None:
    """Raise ScheduleError unless `tasks` runs every task of the layout exactly once, each after its
    prerequisite (F before its B or I, I before its W)."""
    layout._check_rank(pp_rank)
    expected = set(layout.tasks())
    seen: set[Task] = set()
    for position, task in enumerate(tasks):
        if task not in expected:
            hint = ""
            if task.kind is not TaskKind.FORWARD:
                hint = (" (this layout splits each backward into I and W)" if layout.split_backward
                        else " (this layout runs each backward as one B)")
            raise ScheduleError(
                f"rank {pp_rank}: task {task} at position {position} is outside the layout "
                f"(num_chunks={layout.num_chunks}, num_microbatches={layout.num_microbatches}){hint}"
            )
        if task in seen:
            raise ScheduleError(f"rank {pp_rank}: task {task} appears twice (again at position {position})")
        if task.prerequisite is not None and task.prerequisite not in seen:
            what = "forward" if task.prerequisite.is_forward else "input gradient"
            raise ScheduleError(
                f"rank {pp_rank}: {task} at position {position} runs before its {what} {task.prerequisite}"
            )
        seen.add(task)
    missing = sorted(expected - seen)
    if missing:
        shown = format_schedule(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ScheduleError(f"rank {pp_rank}: schedule is missing {len(missing)} task(s): {shown}")


def format_schedule(tasks: Iterable[Task]) -> str:
    return " ".join(str(task) for task in tasks)


def parse_schedule(text: str) -> list[Task]:
    """Inverse of format_schedule; accepts whitespace or commas between tasks."""
    tasks = []
    for position, token in enumerate(text.replace(",", " ").split()):
        try:
            tasks.append(Task.parse(token))
        except ValueError as error:
            raise ValueError(f"schedule token {position}: {error}") from None
    return tasks
