"""shm_tensor_rdma: asynchronous, multithreaded tensor P2P between ranks.

Many isend/irecv can be in flight per peer; each returns a Handle, and `Endpoint.poll()` /
`Endpoint.wait_any()` report whichever finished first, so a dynamic pipeline scheduler can
run the task whose input arrived. Transports: POSIX shared memory on one host, RDMA verbs
between hosts with RDMA devices, TCP otherwise. See docs/shm_tensor_rdma.md.
"""
from __future__ import annotations

from . import _C
from .checks import DEFAULT
from .endpoint import Endpoint, EndpointConfig
from .errors import (
    EndpointClosedError,
    PeerError,
    TensorMismatchError,
    TransferTimeout,
    TransportError,
)
from .handle import Handle
from .tags import make_tag, split_tag


def verbs_compiled() -> bool:
    """True when this build includes the RDMA verbs transport."""
    return bool(_C.verbs_compiled())


def rdma_ports() -> tuple[list[str], str]:
    """(one line per RDMA device port, reason when there are none)."""
    ports, error = _C.verbs_device_ports()
    return list(ports), error


__all__ = [
    "DEFAULT",
    "Endpoint",
    "EndpointClosedError",
    "EndpointConfig",
    "Handle",
    "PeerError",
    "TensorMismatchError",
    "TransferTimeout",
    "TransportError",
    "make_tag",
    "rdma_ports",
    "split_tag",
    "verbs_compiled",
]
