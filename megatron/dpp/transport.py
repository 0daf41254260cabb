"""P2P transports for the dynamic executor: shm_tensor_rdma (idle time blocks in wait_any) and
per-message torch.distributed isend/irecv (readiness via work.is_completed())."""
from __future__ import annotations

import threading
import time
from typing import Sequence

import torch
import torch.distributed as dist

from megatron.app.transport import Message


class _WorkHandle:
    __slots__ = ("work", "tensor")

    def __init__(self, work, tensor: torch.Tensor) -> None:
        self.work = work
        self.tensor = tensor  # gloo reads/writes it after post() returns: keep it alive

    def wait(self) -> None:
        self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _WatchedReceive:
    """A gloo receive whose completion a helper thread observes: gloo's work.is_completed() only
    turns true once someone called wait(), so polling it alone would never see an arrival."""

    __slots__ = ("work", "tensor", "_done", "_error")

    def __init__(self, work, tensor: torch.Tensor, transport: "TorchP2PTransport") -> None:
        self.work = work
        self.tensor = tensor
        self._done = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._watch, args=(transport,), daemon=True, name="dpp-recv").start()

    def _watch(self, transport: "TorchP2PTransport") -> None:
        try:
            self.work.wait()
        except BaseException as exc:  # surfaced to the scheduler by wait()/is_completed()
            self._error = exc
        self._done.set()
        transport._notify()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        if self._done.is_set() and self._error is not None:
            raise self._error
        return self._done.is_set()


class TorchP2PTransport:
    """One isend/irecv per message (not batched), so each receive completes on its own and the
    scheduler can run whichever input arrived; `wait_any` sleeps until any receive completes.
    Tag-matched: gloo only (see check_transport)."""

    name = "torch"

    def __init__(self, group=None) -> None:
        self.group = group
        self._completed = threading.Condition()
        self._completions = 0
        self._seen = 0

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> list:
        handles: list = [_WorkHandle(dist.isend(m.tensor, m.peer, group=self.group, tag=m.tag), m.tensor)
                         for m in sends]
        handles += [_WatchedReceive(dist.irecv(m.tensor, m.peer, group=self.group, tag=m.tag), m.tensor, self)
                    for m in recvs]
        return handles

    def _notify(self) -> None:
        with self._completed:
            self._completions += 1
            self._completed.notify_all()

    def wait_any(self, timeout: float) -> None:
        """Block (GIL released) until a receive completed since the last call, or `timeout` s."""
        with self._completed:
            if self._completions == self._seen:
                self._completed.wait(timeout)
            self._seen = self._completions

    def close(self) -> None:
        return None


def make_shm_transport(*, workload_bytes: int, multi_node: bool, node_ips: Sequence[str],
                       ranks_per_node: int | None, job_id: str = "megadpp"):
    """An endpoint over every rank of the default process group, wrapped as a transport that also
    offers `wait_any(timeout)`. Single node: shared memory only. Multi-node: shm within a host,
    verbs or TCP across hosts; with --node-ips each rank publishes its node's address."""
    from megatron.shm_tensor_rdma import Endpoint, EndpointConfig
    from megatron.shm_tensor_rdma.transport import ShmTensorTransport

    class ShmWaitAnyTransport(ShmTensorTransport):
        def wait_any(self, timeout: float) -> None:
            if self.endpoint.in_flight == 0:
                time.sleep(timeout)  # e.g. only injected delays pending: nothing to be woken by
                return
            self.endpoint.wait_any(timeout)

    config = EndpointConfig(workload_bytes=workload_bytes,
                            transports=("shm", "verbs", "tcp") if multi_node else ("shm",))
    host = None
    if multi_node and node_ips:
        per_node = ranks_per_node or max(1, dist.get_world_size() // len(node_ips))
        host = node_ips[min(dist.get_rank() // per_node, len(node_ips) - 1)]
    endpoint = Endpoint.from_process_group(job_id, host=host, config=config)
    return ShmWaitAnyTransport(endpoint)
