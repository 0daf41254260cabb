"""P2P transports for pipeline activations and gradients.

A transport moves tensors between pipeline ranks: `post(sends, recvs)` starts a batch of
asynchronous sends and receives and returns handles; `handle.wait()` blocks for one. The first
transport is torch.distributed (gloo/NCCL); plugins may supply others (shm_tensor_rdma).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from megatron.app.actions import message_tag  # noqa: F401  (the one tag function; re-exported)


@dataclass(frozen=True, slots=True)
class Message:
    """One P2P message. `tag` identifies (kind, virtual stage, microbatch) so the receiver can
    match it; `peer` is a global rank."""

    peer: int
    tag: int
    tensor: torch.Tensor


class Handle(Protocol):
    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class Transport(Protocol):
    name: str

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> list[Handle]: ...

    def close(self) -> None: ...


class _DoneHandle:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _WorkHandle:
    def __init__(self, work) -> None:
        self.work = work

    def wait(self) -> None:
        self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


class TorchDistributedTransport:
    """torch.distributed isend/irecv. A batch is posted with `batch_isend_irecv` so that a
    send and a receive with the same peer progress together (NCCL needs this to avoid the
    send/recv ordering deadlock of 1F1B's steady state)."""

    name = "torch"

    def __init__(self, group=None) -> None:
        self.group = group

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> list[Handle]:
        ops = [dist.P2POp(dist.isend, m.tensor, m.peer, self.group, m.tag) for m in sends]
        ops += [dist.P2POp(dist.irecv, m.tensor, m.peer, self.group, m.tag) for m in recvs]
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        return [_WorkHandle(w) for w in works]

    def close(self) -> None:
        return None
