"""The one pipeline executor: runs a rank's iteration as actions (megatron.app.actions) on its
model chunks, from a static order lowered by the IR's pass or from a dynamic order source
(MegaDPP); actions are dispatched through a handler table and P2P goes through a Transport.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron.app import weight_grad
from megatron.app.activation_memory import ActivationMeter
from megatron.app.model import unwrap_model
from megatron.app.rng import rng_restore, rng_snapshot
from megatron.app.observer import get_observer
from megatron.app.actions import Action, Op, lower
from megatron.app.iteration import (IterationPlan, IterationResult, IterationSteps, LossOptions,  # noqa: F401
                                    Microbatch, microbatch_loss)
from megatron.app.schedule import PipelineLayout, Task, format_schedule
from megatron.app.transport import Message, TorchDistributedTransport, Transport

logger = logging.getLogger(__name__)

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


Handler = Callable[["Action", Callable[[int], "Microbatch"]], None]


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

    A split backward (a layout with split_backward) runs as I, the stage input's gradient, sent
    upstream at once, and W, the weight gradients I left (megatron.app.weight_grad): no part of the
    backward runs twice, and W may run whenever the order places it.

    Messages are keyed by (task, payload): an activation (F) or gradient (B, I) by default; a stage
    input (S) or RNG state (R) where a forward hands them to a recomputation on another rank
    (`hand_off`; RECOMPUTE consumes them). `buffers` adds a receive buffer maker per payload. A
    WEIGHTS action has no handler here: the action list that holds one passes it in `handlers`.
    Everything is given at construction; nothing is set on an executor afterwards.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], stage: StageContext,
                 transport: Transport | None = None, order=None, *, loss: LossOptions = LossOptions(),
                 handlers: Mapping[Op, Handler] | None = None,
                 buffers: Mapping[str, Callable[[], torch.Tensor]] | None = None, hand_off: bool = False,
                 compute_guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 measure_memory: bool = False) -> None:
        self.chunks = list(chunks)
        self.stage = stage
        self.transport = transport or TorchDistributedTransport()
        self.order = order or StaticOrder()
        self.loss = loss
        self.handlers: dict[Op, Handler] = {
            Op.FORWARD: self._forward,
            Op.BACKWARD: self._backward,
            Op.INPUT_GRAD: self._input_grad,
            Op.WEIGHT_GRAD: self._weight_grad,
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
        # bytes kept for backward (stored forwards, pending W), when measured: peak over every iteration
        self.memory = ActivationMeter(p for c in self.chunks for p in c.parameters()) if measure_memory else None
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
        self._weight_work: dict[tuple[int, int], weight_grad.WeightGradWork] = {}  # forwards' and I's, until W
        if self.layout.split_backward and not forward_only:
            weight_grad.install(self.chunks)
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
                    stored = len(self._stored.keys() | self._weight_work.keys())  # until B, or until W
                    self.peak_stored_activations = max(self.peak_stored_activations, stored)
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
            self._weight_work.clear()
            if self.memory is not None:
                self.memory.clear()
            self._inbox.clear()
            self._outbox.clear()
        return self._result

    # --- what order sources may use -----------------------------------------------------
    def input_arrived(self, task: Task) -> bool:
        """Whether `task`'s input is here: local, or its posted receive has completed."""
        self.flush()
        key = (task, task.message)
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
                                 microbatch=action.task.microbatch, direction=action.task.message,
                                 **_payload_attr(action)), key))

    def _queue_receive(self, action: Action, get_microbatch) -> None:
        buffer = self.buffers[action.carries]()
        peer = action.peer
        self._receives.append(((action.task, action.carries), Message(peer, action.tag, buffer),
                               dict(peer=peer, bytes=buffer.numel() * buffer.element_size(), chunk=action.task.chunk,
                                    microbatch=action.task.microbatch, direction=action.task.message,
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
        key = (task, payload or task.message)
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
        key = (task.chunk, task.microbatch)
        with contextlib.ExitStack() as scope:
            if train and self.layout.split_backward:  # the linear layers leave their weight gradients to W
                self._weight_work[key] = weight_grad.WeightGradWork()
                scope.enter_context(weight_grad.deferring(self._weight_work[key]))
            if train and self.memory is not None:
                scope.enter_context(self.memory.forward(key))
            self._compute_forward(task, chunk, batch, received, train=train, keep_output=keep_output)

    def _compute_forward(self, task: Task, chunk, batch: Microbatch, received: torch.Tensor | None, *, train: bool,
                         keep_output: bool) -> None:
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
                    self._outbox[(task, task.message)] = output.detach()
        if train:
            self._stored[(task.chunk, task.microbatch)] = (received, output)

    def _backward(self, action: Action, get_microbatch: Callable[[int], Microbatch]) -> None:
        """B, or a split backward's I: everything but the deferred weight gradients, which the
        forward's work (still open here, for recomputation) collects for W."""
        task = action.task
        key = (task.chunk, task.microbatch)
        stage_input, output = self._stored.pop(key)
        grad_output = self._receive(task)
        if grad_output is None and self.loss.scale is not None:
            output = self.loss.scale(output)
        work = self._weight_work.get(key)
        with get_observer().span("backward", chunk=task.chunk, microbatch=task.microbatch,
                                 **({"part": "input"} if work is not None else {})):
            with weight_grad.deferring(work) if work is not None else contextlib.nullcontext():
                torch.autograd.backward(output, grad_tensors=grad_output)
        if stage_input is not None:
            self._outbox[(task, task.message)] = stage_input.grad
        if self.memory is not None:
            self.memory.release(key)
            if work is not None:
                self.memory.hold(("W", key), work.nbytes)

    _input_grad = _backward

    def _weight_grad(self, action: Action, get_microbatch: Callable[[int], Microbatch]) -> None:
        """W: the weight gradients its I left, delivered to the parameters (their hooks run now)."""
        task = action.task
        key = (task.chunk, task.microbatch)
        work = self._weight_work.pop(key)
        with get_observer().span("backward_weight", chunk=task.chunk, microbatch=task.microbatch):
            work.run()
        if self.memory is not None:
            self.memory.release(("W", key))

    # --- the iteration's end --------------------------------------------------------------
    def _reduce_grads(self, action: Action, get_microbatch) -> None:
        self._steps.reduce_grads(self._result)

    def _optimizer_step(self, action: Action, get_microbatch) -> None:
        self._result.updated, self._result.grad_norm = self._steps.optimizer_step(self._result)


def _payload_attr(action: Action) -> dict:
    return {"payload": action.payload} if action.payload else {}
