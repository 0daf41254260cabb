"""Handle: one posted isend or irecv, and how its outcome is reported (`test`, `wait`, `done`).
It asks its endpoint through the Completer interface (completion.py) and is settled by it through
`settle`."""
from __future__ import annotations

import torch

from .completion import DONE, FAILED, PENDING, Completer
from .errors import TransportError


class Handle:
    """One posted isend or irecv. `tensor` is the sent tensor or the receive buffer."""

    __slots__ = ("_completer", "id", "kind", "peer", "tag", "tensor", "_wire", "_state", "_error")

    def __init__(self, completer: Completer, request_id: int, kind: str, peer: int, tag: int,
                 tensor: torch.Tensor, wire: torch.Tensor) -> None:
        self._completer = completer
        self.id = request_id
        self.kind = kind
        self.peer = peer
        self.tag = tag
        self.tensor = tensor
        self._wire = wire  # the host memory the core reads or writes (a staging copy for CUDA)
        self._state = PENDING
        self._error: TransportError | None = None

    @property
    def done(self) -> bool:
        """Finished, successfully or not (never raises)."""
        if self._state == PENDING:
            self._completer.refresh(self)
        return self._state != PENDING

    @property
    def settled(self) -> bool:
        """The endpoint has recorded the outcome (unlike `done`, this does not ask the core)."""
        return self._state != PENDING

    def settle(self, state: int, error: TransportError | None, copy_out: bool) -> torch.Tensor | None:
        """Records the outcome, DONE or FAILED with its `error`; called by the endpoint that took
        this handle out of its `unsettled` table (arguments by position: this runs per message).
        With `copy_out`, a receive through a staging buffer is first copied into `tensor`.
        Returns the staging buffer the handle no longer needs (None when the core used `tensor`)."""
        wire = self._wire
        if copy_out and self.kind == "recv" and wire is not self.tensor:
            self.tensor.copy_(wire)  # a CUDA receive: one copy out of the staging buffer
        self._wire = None
        self._error = error
        self._state = state  # last: a thread that sees the state sees the tensor and the error
        return None if wire is self.tensor else wire

    def exception(self) -> TransportError | None:
        """The failure, once finished with one."""
        self.done
        return self._error

    def test(self) -> bool:
        """True once finished successfully; raises the transfer's error if it failed."""
        if not self.done:
            return False
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Alias of test() matching megatron.app.transport's Handle protocol."""
        return self.test()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Blocks (without the GIL) until finished; returns `tensor`.

        Raises TransferTimeout naming the peer if `timeout` seconds pass first (the transfer
        keeps going and can be waited for again), or the transfer's own error."""
        if self._state == PENDING:
            completer = self._completer
            wait_done = completer.wait_done
            taken = None
            if timeout is None and wait_done is not None and self._wire is self.tensor:
                taken = wait_done(self.id)  # a host tensor with no limit: the short way
                if taken is None:
                    # This thread took the outcome, so no poll() reports it; close() may settle
                    # the handle meanwhile: whoever takes it out of the table settles it.
                    if completer.unsettled.pop(self.id, None) is not None:
                        self._wire = None
                        self._state = DONE
            if self._state == PENDING:
                completer.wait_for(self, timeout, taken)
        if self._error is not None:
            raise self._error
        return self.tensor

    def __repr__(self) -> str:
        state = {PENDING: "pending", DONE: "done", FAILED: "failed"}[self._state]
        arrow = "to" if self.kind == "send" else "from"
        return (f"Handle({self.kind} {arrow} rank {self.peer}, tag={self.tag}, "
                f"{tuple(self.tensor.shape)} {self.tensor.dtype}, {state})")


def deliver_finished(batch: list[Handle], raise_errors: bool) -> list[Handle]:
    """A batch of finished handles as poll()/wait_any() return it: with `raise_errors`, the first
    failed one raises its error, whose `finished` attribute holds the whole batch."""
    if raise_errors:
        for h in batch:
            if h._error is not None:
                h._error.finished = batch
                raise h._error
    return batch
