"""The pipeline IR: one rank's iteration as a list of actions with explicit communication.

A static order (a list of Tasks from megatron.app.schedule) is lowered into actions by one pass,
`lower`: each compute action (F, B, or a split backward's I and W, of a chunk on a microbatch) is preceded by the RECV of its
input when that input comes from another pipeline rank and followed by the SEND of its output
when another rank consumes it; the iteration may end with the gradient reduction and the optimizer
step. A dynamic order (MegaDPP's, the simulator's policies) derives its communication from the
same per-task rule (`sends_after`, `receive_of`) while it picks tasks at run time
(megatron.app.lower_dynamic). The executor
(megatron.app.executor) runs actions over a transport; the simulator derives its transfers from
the same SEND actions. MegaFBD's two roles are lowered by a pass beside this one
(megatron.app.lower_disaggregated). A peer is always a global rank: the passes take the
pipeline's global ranks (`ranks`; the pipeline ranks themselves when the world is one pipeline).
Pure Python; no torch.

    F0.0 on pp rank 1 of 2 -> RECV(F0.0<-0) F0.0 SEND(F0.0->0) ...   (the output of the last
    stage's forward is the loss, kept locally; its backward's gradient goes back to rank 0)
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron.app.schedule import PipelineLayout, Task, TaskKind

__all__ = ["Op", "Action", "PAYLOADS", "message_tag", "control_tag", "compute", "pipeline_ranks", "receive_of",
           "sends_after", "send_of", "lower", "eager_receives", "step_actions", "compute_tasks", "format_actions",
           "check_matching"]


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    INPUT_GRAD = "I"  # a split backward's stage-input gradient (sent upstream as B's is)
    WEIGHT_GRAD = "W"  # a split backward's weight gradients (no message)
    SEND = "SEND"
    RECV = "RECV"
    REDUCE_GRADS = "REDUCE_GRADS"  # data-parallel gradient reduction (and its finalisation)
    OPTIMIZER_STEP = "OPTIMIZER_STEP"
    RECOMPUTE = "RECOMPUTE"  # the forward again, from a handed-off stage input and RNG state (MegaFBD)
    WEIGHTS = "WEIGHTS"  # the weight hand-off between a backward and a forward instance (MegaFBD)

    def __str__(self) -> str:
        return self.value


_COMPUTE = {TaskKind.FORWARD: Op.FORWARD, TaskKind.BACKWARD: Op.BACKWARD, TaskKind.INPUT_GRAD: Op.INPUT_GRAD,
            TaskKind.WEIGHT_GRAD: Op.WEIGHT_GRAD}


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's iteration.

    Compute (F/B/I/W, RECOMPUTE): `task` is what runs. SEND: `task` produced the tensor, `peer` is the
    rank that consumes it. RECV: `task` consumes the tensor, `peer` is the rank that produced it.
    `peer` is always the GLOBAL rank (torch.distributed's) of that process, in every list: the
    trainer's pipelines, MegaDPP's and MegaFBD's; the executor posts to it as it is, and the
    simulators map it back to their programs. `tag` matches a SEND with its RECV; `payload` says
    what the message carries when it is not the task's activation (F) or gradient (B, I's too): "S" a stage
    input, "R" an RNG state (see PAYLOADS). Step actions carry nothing."""

    op: Op
    task: Task | None = None
    peer: int = -1
    tag: int = -1
    payload: str = ""

    @property
    def carries(self) -> str:
        """What a SEND/RECV moves: its payload, else the task's own activation or gradient."""
        return self.payload or self.task.message

    @property
    def is_compute(self) -> bool:
        return self.op in (Op.FORWARD, Op.BACKWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD, Op.RECOMPUTE)

    @property
    def is_communication(self) -> bool:
        return self.op in (Op.SEND, Op.RECV)

    def __str__(self) -> str:
        what = f"{self.task}:{self.payload}" if self.payload else str(self.task)
        if self.op is Op.SEND:
            return f"SEND({what}->{self.peer})"
        if self.op is Op.RECV:
            return f"RECV({what}<-{self.peer})"
        if self.op is Op.RECOMPUTE:
            return f"RECOMPUTE({self.task})"
        if self.is_compute:
            return str(self.task)
        return self.op.value


# --- the one tag function ---------------------------------------------------------------------
# What a P2P message of an iteration carries: "F" an activation entering a virtual stage, "B" a
# gradient entering it, "S" a forward instance's stage input handed to its backward instance
# (MegaFBD), "R" the RNG state of a forward, "W" weights.
PAYLOADS = ("F", "B", "S", "R", "W")


def message_tag(payload: str, virtual_stage: int, microbatch: int, num_microbatches: int) -> int:
    """Unique per message of one iteration between two ranks: `payload` (one of PAYLOADS) for
    `microbatch` at `virtual_stage` (the receiving one for F/B). Gloo matches on it; NCCL matches
    by order."""
    try:
        kind = PAYLOADS.index(payload)
    except ValueError:
        raise ValueError(f"unknown message payload {payload!r}: one of {', '.join(PAYLOADS)}") from None
    return len(PAYLOADS) * (virtual_stage * num_microbatches + microbatch) + kind


def control_tag(layout: PipelineLayout, step: int) -> int:
    """Tags above every data message of the iteration, one per `step` (e.g. a dynamic order's
    decisions sent from the TP leader to the other ranks of its stage)."""
    return len(PAYLOADS) * layout.num_virtual_stages * layout.num_microbatches + step


# --- the lowering pass --------------------------------------------------------------------------
def compute(task: Task) -> Action:
    return Action(_COMPUTE[task.kind], task)


def pipeline_ranks(layout: PipelineLayout, ranks: Sequence[int] | None) -> Sequence[int]:
    """The global rank of each pipeline rank: `ranks` (one per pipeline rank, checked), or the
    pipeline ranks themselves (None: the world is this one pipeline)."""
    if ranks is None:
        return range(layout.pp_size)
    if len(ranks) != layout.pp_size:
        raise ValueError(f"need the global rank of each of the pp_size({layout.pp_size}) pipeline ranks, "
                         f"got {len(ranks)}: {list(ranks)}")
    return ranks


def receive_of(layout: PipelineLayout, pp_rank: int, task: Task, *,
               ranks: Sequence[int] | None = None) -> Action | None:
    """The RECV of `task`'s input from the global rank that produces it (`ranks`: the pipeline's
    global ranks, see pipeline_ranks), or None when the input is local (data for the first stage's
    forward, the loss for the last stage's backward)."""
    source = layout.input_source(pp_rank, task)
    if source is None:
        return None
    tag = message_tag(task.message, layout.virtual_stage(pp_rank, task.chunk), task.microbatch,
                      layout.num_microbatches)
    return Action(Op.RECV, task, pipeline_ranks(layout, ranks)[source[0]], tag)


def send_of(layout: PipelineLayout, pp_rank: int, task: Task, *,
            ranks: Sequence[int] | None = None) -> Action | None:
    """The SEND of `task`'s output to the global rank that consumes it, or None when it stays local."""
    destination = layout.output_destination(pp_rank, task)
    if destination is None:
        return None
    peer_rank, peer_chunk = destination
    tag = message_tag(task.message, layout.virtual_stage(peer_rank, peer_chunk), task.microbatch,
                      layout.num_microbatches)
    return Action(Op.SEND, task, pipeline_ranks(layout, ranks)[peer_rank], tag)


def sends_after(layout: PipelineLayout, pp_rank: int, task: Task, *, eager: bool = False,
                forward_only: bool = False, ranks: Sequence[int] | None = None) -> list[Action]:
    """Communication that follows `task`: the SEND of its output; with eager receives (a dynamic
    order, which posts every receive as soon as it is legal) also the RECV of its backward's (B's or
    I's) gradient, which can only come after this forward's output went downstream."""
    actions = []
    send = send_of(layout, pp_rank, task, ranks=ranks)
    if send is not None and not (forward_only and not task.is_forward):
        actions.append(send)
    if eager and task.is_forward and not forward_only:
        receive = receive_of(layout, pp_rank, layout.gradient_task(task.chunk, task.microbatch), ranks=ranks)
        if receive is not None:
            actions.append(receive)
    return actions


def eager_receives(layout: PipelineLayout, pp_rank: int, tasks: Iterable[Task], *,
                   ranks: Sequence[int] | None = None) -> list[Action]:
    """The receives a dynamic order posts before its first task: every forward's input."""
    return [r for task in tasks if task.is_forward
            if (r := receive_of(layout, pp_rank, task, ranks=ranks)) is not None]


def step_actions() -> list[Action]:
    return [Action(Op.REDUCE_GRADS), Action(Op.OPTIMIZER_STEP)]


def lower(layout: PipelineLayout, pp_rank: int, order: Sequence[Task], *, ranks: Sequence[int] | None = None,
          forward_only: bool = False, step: bool = False) -> list[Action]:
    """A static order of compute tasks -> the rank's action list, its peers global ranks
    (`ranks`: the global rank of each pipeline rank; None when the world is this one pipeline).

    The RECV of each task's input is placed right after the previous task's SEND (just-in-time
    receives), so the executor posts them as one batch and blocks only on the input of the task it
    is about to run. A dynamic order uses the same rules with eager receives (`eager_receives`,
    `sends_after(eager=True)`). `forward_only` drops backwards (evaluation); `step` ends the list
    with the gradient reduction and the optimizer step."""
    ranks = pipeline_ranks(layout, ranks)
    tasks = [task for task in order if task.is_forward or not forward_only]
    actions: list[Action] = []
    for index, task in enumerate(tasks):
        if index == 0:
            receive = receive_of(layout, pp_rank, task, ranks=ranks)
            if receive is not None:
                actions.append(receive)
        actions.append(compute(task))
        actions.extend(sends_after(layout, pp_rank, task, forward_only=forward_only, ranks=ranks))
        if index + 1 < len(tasks):
            receive = receive_of(layout, pp_rank, tasks[index + 1], ranks=ranks)
            if receive is not None:
                actions.append(receive)
    if step and not forward_only:
        actions.extend(step_actions())
    return actions


def compute_tasks(actions: Iterable[Action]) -> list[Task]:
    """The compute order of an action list."""
    return [action.task for action in actions if action.is_compute]


def format_actions(actions: Iterable[Action]) -> str:
    return " ".join(str(action) for action in actions)


def check_matching(layout: PipelineLayout, programs: Sequence[Sequence[Action]], *,
                   ranks: Sequence[int] | None = None) -> None:
    """Raise ValueError unless every SEND of every rank's list has exactly one RECV on its peer with
    the same tag, and every RECV one SEND. `ranks`: the global rank of each list (None: the lists
    are those of global ranks 0, 1, ...); peers are global ranks."""
    ranks = range(len(programs)) if ranks is None else ranks
    if len(ranks) != len(programs) or len(set(ranks)) != len(ranks):
        raise ValueError(f"need one distinct global rank per action list: {len(programs)} lists, ranks {list(ranks)}")
    sends: dict[tuple[int, int, int], Action] = {}
    receives: dict[tuple[int, int, int], Action] = {}
    for rank, program in zip(ranks, programs):
        for action in program:
            if action.op is Op.SEND:
                key = (rank, action.peer, action.tag)
                if key in sends:
                    raise ValueError(f"rank {rank} sends tag {action.tag} to rank {action.peer} twice")
                sends[key] = action
            elif action.op is Op.RECV:
                key = (action.peer, rank, action.tag)
                if key in receives:
                    raise ValueError(f"rank {rank} receives tag {action.tag} from rank {action.peer} twice")
                receives[key] = action
    strangers = sorted({key[1] for key in sends} - set(ranks) | {key[0] for key in receives} - set(ranks))
    if strangers:
        raise ValueError(f"peers {strangers} have no action list here (the lists' global ranks: {list(ranks)}); "
                         "peers are global ranks: pass each list's global rank as `ranks`")
    unmatched = sorted(set(sends) ^ set(receives))
    if unmatched:
        src, dst, tag = unmatched[0]
        side = "SEND without RECV" if (src, dst, tag) in sends else "RECV without SEND"
        raise ValueError(f"{len(unmatched)} unmatched message(s); first: {side}, rank {src} -> rank {dst}, tag {tag}")
