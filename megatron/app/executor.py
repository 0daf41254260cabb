"""Runs one iteration's pipeline schedule (a list of Tasks) on this rank's model chunks.

Static orders (1F1B, interleaved) and any other task order run through the same executor;
task kinds are dispatched through a handler table. P2P goes through a Transport.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.app.model import unwrap_model
from megatron.app.observer import get_observer
from megatron.app.schedule import PipelineLayout, Task, TaskKind, format_schedule
from megatron.app.transport import Message, TorchDistributedTransport, Transport, message_tag

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


@dataclass(slots=True)
class IterationResult:
    losses: list[float] = field(default_factory=list)  # one per microbatch, last stage only
    num_tokens: int = 0

    @property
    def mean_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None


def microbatch_loss(output: torch.Tensor, batch: Microbatch) -> tuple[torch.Tensor, int]:
    """The last stage's per-token losses [micro batch, seq] -> their mean over the microbatch's
    real tokens (loss_mask), and that token count."""
    mask = batch["loss_mask"]
    tokens = mask.sum()
    return (output.float() * mask).sum() / tokens.clamp(min=1), int(tokens)


class ScheduleExecutionError(RuntimeError):
    pass


class PipelineExecutor:
    """Executes tasks in the given order, receiving inputs and sending outputs as it goes.

    After each task, the output send and the receive of the next task's input are posted as
    one batch; the executor blocks only on the input of the task it is about to run.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], stage: StageContext,
                 transport: Transport | None = None) -> None:
        self.chunks = list(chunks)
        self.stage = stage
        self.transport = transport or TorchDistributedTransport()
        # --fp16: multiplies the last stage's loss by the loss scale before its backward.
        self.grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.per_token_loss = False  # --calculate-per-token-loss
        self.handlers: dict[TaskKind, Callable[[Task, Callable[[int], Microbatch], bool], None]] = {
            TaskKind.FORWARD: self._forward,
            TaskKind.BACKWARD: self._backward,
        }

    # --- public -----------------------------------------------------------------------
    def run(self, tasks: Sequence[Task], get_microbatch: Callable[[int], Microbatch],
            forward_only: bool = False) -> IterationResult:
        if forward_only:
            tasks = [t for t in tasks if t.kind is TaskKind.FORWARD]
        self._result = IterationResult()
        self._stored: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._inbox: dict[Task, tuple[torch.Tensor, object]] = {}
        self._outbox: dict[Task, torch.Tensor] = {}
        self._pending_sends: list = []
        self._forward_only = forward_only
        index = -1
        try:
            self._post(None, tasks[0] if tasks else None)
            for index, task in enumerate(tasks):
                self.handlers[task.kind](task, get_microbatch, forward_only)
                self._post(task, tasks[index + 1] if index + 1 < len(tasks) else None)
            for handle in self._pending_sends:
                handle.wait()
        except Exception:
            logger.error(
                "rank %d (pp rank %d) failed at task %s of schedule:\n  %s",
                dist.get_rank() if dist.is_initialized() else 0, self.stage.pp_rank,
                tasks[index] if 0 <= index < len(tasks) else "<start>",
                _mark(tasks, index),
            )
            raise
        finally:
            self._stored.clear()
            self._inbox.clear()
            self._outbox.clear()
        return self._result

    # --- communication ----------------------------------------------------------------
    def _post(self, done: Task | None, upcoming: Task | None) -> None:
        layout, pp_rank = self.stage.layout, self.stage.pp_rank
        observer = get_observer()
        sends: list[Message] = []
        recvs: list[Message] = []
        send_attrs = recv_attrs = None
        if done is not None and done in self._outbox:
            dest = layout.output_destination(pp_rank, done)
            tensor = self._outbox.pop(done)
            if dest is not None and not self._skip(done):
                peer_rank, peer_chunk = dest
                tag = message_tag(done.kind.value, layout.virtual_stage(peer_rank, peer_chunk), done.microbatch,
                                  layout.num_microbatches)
                sends.append(Message(self.stage.pp_global_ranks[peer_rank], tag, tensor))
                send_attrs = dict(peer=sends[0].peer, bytes=tensor.numel() * tensor.element_size(),
                                  chunk=done.chunk, microbatch=done.microbatch, direction=done.kind.value)
        if upcoming is not None:
            source = layout.input_source(pp_rank, upcoming)
            if source is not None:
                peer_rank, _ = source
                buffer = torch.empty(self.stage.activation_shape, dtype=self.stage.dtype, device=self.stage.device)
                tag = message_tag(upcoming.kind.value, layout.virtual_stage(pp_rank, upcoming.chunk),
                                  upcoming.microbatch, layout.num_microbatches)
                recvs.append(Message(self.stage.pp_global_ranks[peer_rank], tag, buffer))
                recv_attrs = dict(peer=recvs[0].peer, bytes=buffer.numel() * buffer.element_size(),
                                  chunk=upcoming.chunk, microbatch=upcoming.microbatch,
                                  direction=upcoming.kind.value)
        if not sends and not recvs:
            return
        with observer.span("send", **send_attrs) if send_attrs else _nothing():
            handles = self.transport.post(sends, recvs)
        if sends:
            self._pending_sends.append(handles[0])
        if recvs:
            self._inbox[upcoming] = (recvs[0].tensor, handles[-1], recv_attrs)

    def _receive(self, task: Task) -> torch.Tensor | None:
        if task not in self._inbox:
            return None
        tensor, handle, attrs = self._inbox.pop(task)
        with get_observer().span("recv", **attrs):
            handle.wait()
        return tensor

    def _skip(self, task: Task) -> bool:
        # In forward-only mode no backward will ever consume a gradient.
        return self._forward_only and task.kind is TaskKind.BACKWARD

    # --- task handlers ------------------------------------------------------------------
    def _forward(self, task: Task, get_microbatch: Callable[[int], Microbatch], forward_only: bool) -> None:
        chunk = self.chunks[task.chunk]
        with get_observer().span("data", microbatch=task.microbatch):
            batch = get_microbatch(task.microbatch)
        received = self._receive(task)
        if received is not None:
            received.requires_grad_(not forward_only)
        with get_observer().span("forward", chunk=task.chunk, microbatch=task.microbatch):
            unwrap_model(chunk).set_input_tensor(received)
            is_last = self.stage.layout.is_last_stage(self.stage.pp_rank, task.chunk)
            with torch.set_grad_enabled(not forward_only):
                output = chunk(
                    batch["tokens"], batch["position_ids"], batch["attention_mask"],
                    labels=batch["labels"] if is_last else None,
                )
            if is_last:
                loss, tokens = microbatch_loss(output, batch)
                self._result.losses.append(float(loss.detach()))
                self._result.num_tokens += tokens
                if self.per_token_loss:  # summed; the trainer divides by the global batch's tokens
                    output = (output.float() * batch["loss_mask"]).sum()
                else:
                    output = loss / self.stage.layout.num_microbatches
            else:
                self._outbox[task] = output.detach()
        if not forward_only:
            self._stored[(task.chunk, task.microbatch)] = (received, output)

    def _backward(self, task: Task, get_microbatch: Callable[[int], Microbatch], forward_only: bool) -> None:
        stage_input, output = self._stored.pop((task.chunk, task.microbatch))
        grad_output = self._receive(task)
        if grad_output is None and self.grad_scale_func is not None:
            output = self.grad_scale_func(output)
        with get_observer().span("backward", chunk=task.chunk, microbatch=task.microbatch):
            torch.autograd.backward(output, grad_tensors=grad_output)
        if stage_input is not None:
            self._outbox[task] = stage_input.grad


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _mark(tasks: Sequence[Task], index: int) -> str:
    text = format_schedule(tasks).split()
    if 0 <= index < len(text):
        text[index] = f"[{text[index]}]"
    return " ".join(text)
