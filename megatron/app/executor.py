"""The one pipeline executor: runs a rank's iteration as actions (megatron.app.actions) on its
model chunks, from a static order lowered by the IR's pass or from a dynamic order source
(MegaDPP); actions are dispatched through a handler table and P2P goes through a Transport.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron.app.model import unwrap_model
from megatron.app.rng import rng_restore, rng_snapshot
from megatron.app.observer import get_observer
from megatron.app.actions import Action, Op, lower
from megatron.app.schedule import PipelineLayout, Task, format_schedule
from megatron.app.transport import Message, TorchDistributedTransport, Transport

logger = logging.getLogger(__name__)

Microbatch = dict[str, torch.Tensor]


@dataclass(kw_only=True, slots=True)
class StageContext:
    """What the executor needs to know about this rank's place in the pipeline."""

    layout: PipelineLayout
    pp_rank: int
    pp_global_ranks: list[int]  # global rank of each pipeline rank in this pipeline
    activation_shape: tuple[int, int, int]  # [seq, micro batch, hidden]
    dtype: torch.dtype
    device: torch.device

    def empty_activation(self) -> torch.Tensor:
        """A buffer for one activation or gradient message (every pipeline engine's one spec)."""
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)


def activation_shape(cfg) -> tuple[int, int, int]:
    """[seq, micro batch, hidden] of the tensor passed between pipeline stages."""
    return (cfg.model.seq_length, cfg.training.micro_batch_size, cfg.model.hidden_size)


@dataclass(frozen=True, slots=True)
class IterationPlan:
    """What one iteration runs on this rank, handed to `run()`: the pipeline layout (whose
    microbatch count is this replica's share), the global index of its first microbatch (what
    `get_microbatch` is asked for is that plus the local index), and the count each microbatch's
    loss is divided by (None: the layout's count; a microbatch plan passes the even split's, so
    the step is the even split's whatever this replica's share)."""

    layout: PipelineLayout
    first_microbatch: int = 0
    loss_divisor: int | None = None

    @property
    def divisor(self) -> int:
        return self.loss_divisor or self.layout.num_microbatches


@dataclass(frozen=True, slots=True)
class LossOptions:
    """How the last stage turns a microbatch's loss into what backward starts from: `scale` (with
    --fp16, the optimizer's loss scale) multiplies it; `per_token` (--calculate-per-token-loss)
    sums token losses, which the trainer later divides by the global batch's token count."""

    scale: Callable[[torch.Tensor], torch.Tensor] | None = None
    per_token: bool = False


Handler = Callable[["Action", Callable[[int], "Microbatch"]], None]


@dataclass(slots=True)
class IterationResult:
    losses: list[float] = field(default_factory=list)  # one per microbatch, last stage only
    num_tokens: int = 0
    updated: bool = False  # set by the optimizer step action, when the iteration has one
    grad_norm: float = 0.0

    @property
    def mean_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None


def microbatch_loss(output: torch.Tensor, batch: Microbatch) -> tuple[torch.Tensor, int]:
    """The last stage's per-token losses [micro batch, seq] -> their mean over the microbatch's
    real tokens (loss_mask), and that token count."""
    mask = batch["loss_mask"]
    tokens = mask.sum()
    return (output.float() * mask).sum() / tokens.clamp(min=1), int(tokens)


@dataclass(frozen=True, slots=True)
class IterationSteps:
    """What the step actions of an iteration do (the trainer supplies them): the data-parallel
    gradient reduction, and the optimizer step returning (updated, grad norm). Both see the
    iteration's result so far (losses, token count)."""

    reduce_grads: Callable[[IterationResult], None]
    optimizer_step: Callable[[IterationResult], tuple[bool, float]]


class StaticOrder:
    """The order source of the static schedules: the given tasks, lowered with just-in-time
    receives."""

    name = ""  # the trainer's start-up line names the static schedule itself

    def program(self, executor: "PipelineExecutor", tasks: Sequence[Task], forward_only: bool,
                step: bool) -> Iterable[Action]:
        stage = executor.stage
        return lower(executor.layout, stage.pp_rank, tasks, ranks=stage.pp_global_ranks, forward_only=forward_only,
                     step=step)


class ActionList:
    """An order source that is a fixed action list (MegaFBD's roles build theirs themselves)."""

    def __init__(self, actions: Sequence[Action], name: str = "") -> None:
        self.actions = list(actions)
        self.name = name

    def program(self, executor: "PipelineExecutor", tasks: Sequence[Task], forward_only: bool,
                step: bool) -> Iterable[Action]:
        return self.actions


class PipelineExecutor:
    """Runs one iteration's actions (megatron.app.actions) on this rank's model chunks.

    An order source turns the iteration's tasks into actions: StaticOrder lowers a fixed order;
    a dynamic source (MegaDPP) yields compute actions as it picks them, with the communication the
    same pass derives. Consecutive SEND/RECV actions are posted as one batch before the next
    compute action, which blocks only on its own input. Order sources may read `stage`, `layout`
    (the running iteration's), `transport`, `forward_only`, `input_arrived(task)` and call
    `flush()`, `idle(timeout)` and `defer(handles)`.

    Messages are keyed by (task, payload): an activation (F) or gradient (B) by default; a stage
    input (S) or RNG state (R) where a forward hands them to a recomputation on another rank
    (`hand_off`; RECOMPUTE consumes them). `buffers` adds a receive buffer maker per payload. A
    WEIGHTS action has no handler here: the action list that holds one passes it in `handlers`.
    Everything is given at construction; nothing is set on an executor afterwards.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], stage: StageContext,
                 transport: Transport | None = None, order=None, *, loss: LossOptions = LossOptions(),
                 handlers: Mapping[Op, Handler] | None = None,
                 buffers: Mapping[str, Callable[[], torch.Tensor]] | None = None, hand_off: bool = False,
                 compute_guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        self.chunks = list(chunks)
        self.stage = stage
        self.transport = transport or TorchDistributedTransport()
        self.order = order or StaticOrder()
        self.loss = loss
        self.handlers: dict[Op, Handler] = {
            Op.FORWARD: self._forward,
            Op.BACKWARD: self._backward,
            Op.SEND: self._queue_send,
            Op.RECV: self._queue_receive,
            Op.REDUCE_GRADS: self._reduce_grads,
            Op.OPTIMIZER_STEP: self._optimizer_step,
            Op.RECOMPUTE: self._recompute,
            **(handlers or {}),
        }
        self.buffers: dict[str, Callable[[], torch.Tensor]] = {
            **{payload: stage.empty_activation for payload in "FBS"}, **(buffers or {})}
        self.hand_off = hand_off  # each forward also leaves its stage input (S) and RNG state (R) to send
        self.compute_guard = compute_guard
        self._plan = IterationPlan(stage.layout)
        self.last_order: list[Task] = []  # compute tasks of the last iteration, in run order
        self.last_actions: list[Action] = []  # every action of the last iteration, in run order
        self.peak_stored_activations = 0  # over every iteration run so far
        self.forward_only = False

    @property
    def schedule_name(self) -> str:
        """What the trainer's start-up line prints as the schedule ("" for a static order)."""
        return getattr(self.order, "name", "")

    @property
    def layout(self) -> PipelineLayout:
        """The pipeline layout of the iteration running (or last run): the plan's."""
        return self._plan.layout

    # --- public -----------------------------------------------------------------------
    def run(self, tasks: Sequence[Task], get_microbatch: Callable[[int], Microbatch],
            forward_only: bool = False, steps: IterationSteps | None = None,
            plan: IterationPlan | None = None) -> IterationResult:
        """One iteration: `tasks` is the static order (a dynamic order source uses only which kinds
        run); with `steps` the iteration ends with the gradient reduction and the optimizer step.
        `plan` (default: the stage's layout, microbatches from 0, the layout's loss divisor) says
        which microbatches run: `get_microbatch` is asked for the plan's global indices."""
        self._plan = plan or IterationPlan(self.stage.layout)
        if self._plan.first_microbatch:
            first, fetch = self._plan.first_microbatch, get_microbatch
            get_microbatch = lambda mb: fetch(first + mb)  # noqa: E731
        self.forward_only = forward_only
        self._steps = steps
        self._result = IterationResult()
        self._stored: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._inbox: dict[tuple[Task, str], tuple[torch.Tensor, object, dict]] = {}
        self._outbox: dict[tuple[Task, str], torch.Tensor] = {}
        self._sends: list[tuple[Message, dict, tuple[Task, str]]] = []  # queued, posted with the next batch
        self._receives: list[tuple[tuple[Task, str], Message, dict]] = []
        self._pending_sends: list = []
        self.last_order, self.last_actions = [], []
        action = None
        try:
            for action in self.order.program(self, tasks, forward_only, steps is not None):
                if action.is_compute or not action.is_communication:
                    self.flush()
                self.handlers[action.op](action, get_microbatch)
                self.last_actions.append(action)
                if action.is_compute:
                    self.last_order.append(action.task)
                    self.peak_stored_activations = max(self.peak_stored_activations, len(self._stored))
            self.flush()
            for handle in self._pending_sends:
                handle.wait()
        except Exception:
            logger.error(
                "rank %d (pp rank %d) failed at %s; ran: %s",
                dist.get_rank() if dist.is_initialized() else 0, self.stage.pp_rank,
                action if action is not None else "<start>", format_schedule(self.last_order) or "nothing",
            )
            raise
        finally:
            self._stored.clear()
            self._inbox.clear()
            self._outbox.clear()
        return self._result

    # --- what order sources may use -----------------------------------------------------
    def input_arrived(self, task: Task) -> bool:
        """Whether `task`'s input is here: local, or its posted receive has completed."""
        self.flush()
        key = (task, task.kind.value)
        if key in self._inbox:
            return self._inbox[key][1].is_completed()
        return self.layout.input_source(self.stage.pp_rank, task) is None

    def idle(self, timeout_s: float) -> None:
        """Nothing to run: sleep until any transfer completes (or `timeout_s`)."""
        self.flush()
        wait_any = getattr(self.transport, "wait_any", None)
        if wait_any is not None:
            wait_any(timeout_s)
        else:
            time.sleep(timeout_s / 5)

    def defer(self, handles: Iterable) -> None:
        """Handles of sends the order source posted itself, waited for at the iteration's end."""
        self._pending_sends.extend(handles)

    # --- communication ----------------------------------------------------------------
    def _queue_send(self, action: Action, get_microbatch) -> None:
        key = (action.task, action.carries)
        tensor = self._outbox[key]  # one output may go to several peers: dropped once the batch is posted
        peer = action.peer
        self._sends.append((Message(peer, action.tag, tensor),
                            dict(peer=peer, bytes=tensor.numel() * tensor.element_size(), chunk=action.task.chunk,
                                 microbatch=action.task.microbatch, direction=action.task.kind.value,
                                 **_payload_attr(action)), key))

    def _queue_receive(self, action: Action, get_microbatch) -> None:
        buffer = self.buffers[action.carries]()
        peer = action.peer
        self._receives.append(((action.task, action.carries), Message(peer, action.tag, buffer),
                               dict(peer=peer, bytes=buffer.numel() * buffer.element_size(), chunk=action.task.chunk,
                                    microbatch=action.task.microbatch, direction=action.task.kind.value,
                                    **_payload_attr(action))))

    def flush(self) -> None:
        """Post the queued sends and receives as one batch (an order source calls it before it blocks
        on anything but this executor). Each send gets its own span (the first one's covers the post)."""
        if not self._sends and not self._receives:
            return
        sends, receives = self._sends, self._receives
        self._sends, self._receives = [], []
        observer = get_observer()
        with observer.span("send", **sends[0][1]) if sends else contextlib.nullcontext():
            handles = self.transport.post([m for m, _, _ in sends], [m for _, m, _ in receives])
        for _, attrs, _ in sends[1:]:
            with observer.span("send", **attrs):
                pass
        for _, _, key in sends:
            self._outbox.pop(key, None)
        self._pending_sends.extend(handles[:len(sends)])
        for (key, message, recv_attrs), handle in zip(receives, handles[len(sends):]):
            self._inbox[key] = (message.tensor, handle, recv_attrs)

    def _receive(self, task: Task, payload: str | None = None) -> torch.Tensor | None:
        key = (task, payload or task.kind.value)
        if key not in self._inbox:
            return None
        tensor, handle, attrs = self._inbox.pop(key)
        with get_observer().span("recv", **attrs):
            handle.wait()
        return tensor

    # --- compute --------------------------------------------------------------------------
    def _forward(self, action: Action, get_microbatch: Callable[[int], Microbatch]) -> None:
        task = action.task
        with get_observer().span("data", microbatch=task.microbatch):
            batch = get_microbatch(task.microbatch)
        self._run_forward(task, batch, self._receive(task), train=not self.forward_only, keep_output=True)

    def _recompute(self, action: Action, get_microbatch: Callable[[int], Microbatch]) -> None:
        """The forward again, with autograd, from a stage input (S) and the RNG state (R) another
        rank's forward handed off: it draws the same dropout and computes the same output."""
        task = action.task
        with get_observer().span("data", microbatch=task.microbatch):
            batch = get_microbatch(task.microbatch)
        stage_input = self._receive(task, "S")
        rng = self._receive(task, "R")
        if rng is not None:
            rng_restore(rng)
        self._run_forward(task, batch, stage_input, train=True, keep_output=False)

    def _run_forward(self, task: Task, batch: Microbatch, received: torch.Tensor | None, *, train: bool,
                     keep_output: bool) -> None:
        chunk = self.chunks[task.chunk]
        if received is not None:
            received.requires_grad_(train)
        with self.compute_guard():
            if self.hand_off:
                self._outbox[(task, "R")] = rng_snapshot()
                if received is not None:
                    self._outbox[(task, "S")] = received
            with get_observer().span("forward", chunk=task.chunk, microbatch=task.microbatch):
                unwrap_model(chunk).set_input_tensor(received)
                is_last = self.layout.is_last_stage(self.stage.pp_rank, task.chunk)
                with torch.set_grad_enabled(train):
                    output = chunk(
                        batch["tokens"], batch["position_ids"], batch["attention_mask"],
                        labels=batch["labels"] if is_last else None,
                    )
                if is_last:
                    loss, tokens = microbatch_loss(output, batch)
                    self._result.losses.append(float(loss.detach()))
                    self._result.num_tokens += tokens
                    if self.loss.per_token:  # summed; the trainer divides by the global batch's tokens
                        output = (output.float() * batch["loss_mask"]).sum()
                    else:
                        output = loss / self._plan.divisor
                elif keep_output:
                    self._outbox[(task, task.kind.value)] = output.detach()
        if train:
            self._stored[(task.chunk, task.microbatch)] = (received, output)

    def _backward(self, action: Action, get_microbatch: Callable[[int], Microbatch]) -> None:
        task = action.task
        stage_input, output = self._stored.pop((task.chunk, task.microbatch))
        grad_output = self._receive(task)
        if grad_output is None and self.loss.scale is not None:
            output = self.loss.scale(output)
        with get_observer().span("backward", chunk=task.chunk, microbatch=task.microbatch):
            torch.autograd.backward(output, grad_tensors=grad_output)
        if stage_input is not None:
            self._outbox[(task, task.kind.value)] = stage_input.grad

    # --- the iteration's end --------------------------------------------------------------
    def _reduce_grads(self, action: Action, get_microbatch) -> None:
        self._steps.reduce_grads(self._result)

    def _optimizer_step(self, action: Action, get_microbatch) -> None:
        self._result.updated, self._result.grad_norm = self._steps.optimizer_step(self._result)


def _payload_attr(action: Action) -> dict:
    return {"payload": action.payload} if action.payload else {}
