"""Exceptions raised by shm_tensor_rdma. Every transfer failure names the peer rank."""
from __future__ import annotations


class TransportError(RuntimeError):
    """A transfer or the endpoint failed. `peer_rank` is the rank involved, when there is one."""

    def __init__(self, message: str, peer_rank: int | None = None) -> None:
        super().__init__(message)
        self.peer_rank = peer_rank
        # Handles reported by the same poll()/wait_any() call, so none is lost when it raises.
        self.finished: list = []


class PeerError(TransportError):
    """The peer died, closed its endpoint, or could not be reached during setup."""


class TransferTimeout(TransportError, TimeoutError):
    """A transfer did not finish within its timeout."""


class TensorMismatchError(TransportError, ValueError):
    """Sender and receiver disagree on dtype, shape or size for one (peer, tag)."""


class EndpointClosedError(TransportError):
    """The endpoint was closed while the transfer was in flight, or before it was posted."""


# Error kinds as numbered by the C++ core (ErrorKind in csrc/common.h).
_BY_KIND: dict[int, type[TransportError]] = {
    1: PeerError,
    2: TransferTimeout,
    3: TensorMismatchError,
    4: EndpointClosedError,
    5: TransportError,
}


def error_for(kind: int, message: str, peer_rank: int | None) -> TransportError:
    return _BY_KIND.get(kind, TransportError)(message, peer_rank)
