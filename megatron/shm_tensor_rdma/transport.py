"""An Endpoint as a `megatron.app.transport.Transport`, so the pipeline executor can move
activations and gradients over shm_tensor_rdma instead of torch.distributed P2P."""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .endpoint import Endpoint
from .handle import Handle


class _Message(Protocol):  # structurally megatron.app.transport.Message
    peer: int
    tag: int
    tensor: torch.Tensor


class ShmTensorTransport:
    """`post(sends, recvs)` posts every message at once and returns one Handle per message,
    sends first; receives land in the messages' own tensors. Handles offer `wait()` and
    `is_completed()` as the executor expects, and the endpoint's `poll()`/`wait_any()` stay
    available for schedulers that run whichever input arrived first."""

    name = "shm_tensor_rdma"

    def __init__(self, endpoint: Endpoint, *, close_endpoint: bool = True) -> None:
        self.endpoint = endpoint
        self._close_endpoint = close_endpoint

    def post(self, sends: Sequence[_Message], recvs: Sequence[_Message]) -> list[Handle]:
        handles = [self.endpoint.isend(m.tensor, m.peer, m.tag) for m in sends]
        handles += [self.endpoint.irecv(m.tensor, m.peer, m.tag) for m in recvs]
        return handles

    def close(self) -> None:
        if self._close_endpoint:
            self.endpoint.close()
