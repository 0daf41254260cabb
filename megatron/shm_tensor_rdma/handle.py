"""Handle: one posted isend or irecv, and how its outcome is reported (`test`, `wait`, `done`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import TransportError

if TYPE_CHECKING:
    from .endpoint import Endpoint

_PENDING, _DONE, _FAILED = 0, 1, 2


class Handle:
    """One posted isend or irecv. `tensor` is the sent tensor or the receive buffer."""

    __slots__ = ("_endpoint", "id", "kind", "peer", "tag", "tensor", "_wire", "_state", "_error")

    def __init__(self, endpoint: "Endpoint", request_id: int, kind: str, peer: int, tag: int,
                 tensor: torch.Tensor, wire: torch.Tensor) -> None:
        self._endpoint = endpoint
        self.id = request_id
        self.kind = kind
        self.peer = peer
        self.tag = tag
        self.tensor = tensor
        self._wire = wire  # the host memory the core reads or writes (a staging copy for CUDA)
        self._state = _PENDING
        self._error: TransportError | None = None

    @property
    def done(self) -> bool:
        """Finished, successfully or not (never raises)."""
        if self._state == _PENDING:
            self._endpoint._refresh(self)
        return self._state != _PENDING

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
        if self._state == _PENDING:
            endpoint = self._endpoint
            wait_done = endpoint._wait_done
            if timeout is None and wait_done is not None and self._wire is self.tensor:
                failed = wait_done(self.id)  # a host tensor with no limit: the short way
                if failed is None:
                    # This thread took the outcome, so no poll() reports it; close() may settle
                    # the handle meanwhile: whoever takes it out of the table settles it.
                    if endpoint._handles.pop(self.id, None) is not None:
                        self._wire = None
                        self._state = _DONE
                else:
                    with endpoint._lock:
                        if self._state == _PENDING and failed[1] in (_DONE, _FAILED):
                            endpoint._settle(self, failed[1], failed[2], failed[3])
            if self._state == _PENDING:
                endpoint._wait_handle(self, timeout)
        if self._error is not None:
            raise self._error
        return self.tensor

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _DONE: "done", _FAILED: "failed"}[self._state]
        arrow = "to" if self.kind == "send" else "from"
        return (f"Handle({self.kind} {arrow} rank {self.peer}, tag={self.tag}, "
                f"{tuple(self.tensor.shape)} {self.tensor.dtype}, {state})")


def _deliver(batch: list[Handle], raise_errors: bool) -> list[Handle]:
    if raise_errors:
        for h in batch:
            if h._error is not None:
                h._error.finished = batch
                raise h._error
    return batch
