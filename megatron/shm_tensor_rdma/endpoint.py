"""The public API: an Endpoint per rank posts asynchronous tensor sends and receives, and
Handles (handle.py) report their completion, asking the endpoint through the Completer interface
(completion.py) that it implements. The C++ core does the work on its own threads; this
module checks arguments, keeps tensors alive while the core uses them, and raises typed errors
(CUDA tensors by IPC handle: device_transfers.py). Over 400 lines because those three belong to
each call of the one API and read best side by side."""
from __future__ import annotations

import atexit
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Sequence

import torch

from . import _C
from .checks import DEFAULT, INT64_RANGE, ConfigDefault, check_int, check_rank_args, check_tensor, port_of
from .completion import DONE, FAILED, PENDING, Outcome
from .cuda_ipc import CudaIpc, device_key
from .device_transfers import DEVICE_COPY, DeviceTransfers
from .dtypes import dtype_code, dtype_names, known_codes
from .errors import EndpointClosedError, PeerError, TransferTimeout, TransportError, error_for
from .handle import Handle, deliver_finished
from .host import default_host, host_key
from .staging import PinnedPool

_TRANSPORTS = ("shm", "verbs", "tcp")
# The core reads a plain CPU tensor's pointer, size, dtype and shape itself (the fast path of
# send/recv/isend/irecv); everything else goes through the checks below.
_C.set_torch_refs(torch.Tensor, *known_codes())


@dataclass(kw_only=True, slots=True)
class EndpointConfig:
    """Tuning and policy of one endpoint. Defaults suit a few ranks per host."""

    send_threads: int | None = None  # threads copying outgoing chunks (shm); None: by CPU count
    recv_threads: int | None = None  # threads draining the inbox (shm); None: by CPU count
    workload_bytes: int = 256 << 10  # chunk size: large tensors are split across threads by it
    eager_bytes: int = 4096        # messages up to this size skip the size handshake
    shm_ctrl_slots: int = 128      # control slots per peer (power of two)
    shm_bulk_slots: int = 16       # data chunk slots per peer (power of two)
    spin_us: int = 50              # a waiting caller polls this long before sleeping
    single_copy: bool = True       # shm: large messages read straight out of the sender's memory
    transports: tuple[str, ...] = _TRANSPORTS  # allowed; chosen per peer: shm > verbs > tcp
    verbs_device: str = ""         # RDMA device name; "" = first with an active port
    transfer_timeout: float | None = 600.0  # default per-transfer timeout (None: none)
    connect_timeout: float = 120.0
    bind_host: str = "0.0.0.0"
    host_key: str | None = None    # None: boot id + network namespace (see host.host_key)
    cuda_ipc: bool = True          # CUDA tensors to same-host peers that see the GPU: IPC handle, no staging

    def validate(self) -> None:
        unknown = set(self.transports) - set(_TRANSPORTS)
        if unknown or not self.transports:
            raise ValueError(f"transports must be a non-empty subset of {_TRANSPORTS}, got {self.transports}")
        if self.transfer_timeout is not None and not self.transfer_timeout > 0:
            raise ValueError(f"transfer_timeout must be > 0 or None, got {self.transfer_timeout}")
        if not self.connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0, got {self.connect_timeout}")

    def resolved_threads(self) -> tuple[int, int]:
        """Copy threads per direction. A waiting caller copies too, and with few cores more
        threads only preempt each other (measured: one thread each is 2-3x faster on 2 cores)."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        auto = 1 if cpus <= 4 else 2
        return (self.send_threads or auto, self.recv_threads or auto)


class Endpoint(DeviceTransfers):
    """This rank's end of the P2P library: isend/irecv to any rank of the job.

    Build it with explicit addresses (one "host:port" per rank, this rank listens on its own)
    or with `from_store` / `from_process_group`, which bind a free port and swap addresses
    through a torch.distributed Store. Transports are chosen per peer: shared memory on the
    same host, else RDMA verbs when both sides have a device, else TCP.

    `unsettled`, `wait_done`, `refresh` and `wait_for` are the Completer side its Handles use
    (completion.py); `Handle.wait` and `Handle.done` are the way to call them.
    """

    def __init__(self, job_id: str, rank: int, world_size: int, peer_addresses: Sequence[str], *,
                 config: EndpointConfig | None = None) -> None:
        check_rank_args(rank, world_size)
        addresses = [str(a) for a in peer_addresses]
        if len(addresses) != world_size:
            raise ValueError(f"peer_addresses has {len(addresses)} entries, expected world_size={world_size}")
        port = port_of(addresses[rank], rank)
        self._start(job_id, rank, world_size, config, port)
        self._connect(addresses)

    @classmethod
    def from_store(cls, store: torch.distributed.Store, job_id: str, rank: int, world_size: int, *,
                   host: str | None = None, config: EndpointConfig | None = None) -> "Endpoint":
        """Binds a free port, publishes "host:port" in `store` and reads every other rank's.

        All ranks must call it with the same job_id. Creating the endpoint again later with the
        same store and job_id works: each round of creations uses fresh keys."""
        check_rank_args(rank, world_size)
        self = cls.__new__(cls)
        self._start(job_id, rank, world_size, config, 0)
        try:
            prefix = f"shm_tensor_rdma/{job_id}/"
            generation = (store.add(prefix + "joined", 1) - 1) // world_size
            keys = [f"{prefix}{generation}/{r}" for r in range(world_size)]
            store.set(keys[rank], f"{host or default_host()}:{self._engine.listen_port}")
            store.wait(keys, timedelta(seconds=self._config.connect_timeout))
            addresses = [store.get(k).decode() for k in keys]
        except BaseException:
            self.close()
            raise
        self._connect(addresses)
        return self

    @classmethod
    def from_process_group(cls, job_id: str = "default", *, host: str | None = None,
                           config: EndpointConfig | None = None) -> "Endpoint":
        """An endpoint over all ranks of the default process group, using its store."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        store = dist.distributed_c10d._get_default_store()
        return cls.from_store(store, job_id, dist.get_rank(), dist.get_world_size(), host=host, config=config)

    # ------------------------------------------------------------------ setup

    def _start(self, job_id: str, rank: int, world_size: int, config: EndpointConfig | None, port: int) -> None:
        self._closed = True  # until the engine exists, so close() is safe on failure
        self._engine = None
        self._plain_transfer = self._post_plain = self.wait_done = None  # the core's fast paths, while connected
        self._config = config if config is not None else EndpointConfig()
        self._config.validate()
        if not isinstance(job_id, str) or not job_id or "\n" in job_id:
            raise ValueError(f"job_id must be a non-empty single-line string, got {job_id!r}")
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        c = self._config
        cfg = _C.EngineConfig()
        cfg.job_id, cfg.rank, cfg.world_size = job_id, rank, world_size
        cfg.host_key = c.host_key if c.host_key is not None else host_key()
        cfg.bind_host, cfg.bind_port = c.bind_host, port
        cfg.send_threads, cfg.recv_threads = c.resolved_threads()
        cfg.workload_bytes, cfg.eager_bytes = c.workload_bytes, c.eager_bytes
        cfg.shm_ctrl_slots, cfg.shm_bulk_slots, cfg.spin_us = c.shm_ctrl_slots, c.shm_bulk_slots, c.spin_us
        cfg.allow_shm, cfg.allow_tcp, cfg.allow_verbs = ("shm" in c.transports, "tcp" in c.transports,
                                                         "verbs" in c.transports)
        cfg.verbs_device = c.verbs_device
        cfg.single_copy = bool(c.single_copy)
        cfg.dtype_names = dtype_names()
        # The GPUs this process can open peers' IPC handles on and a probe handle for peers to try,
        # told to every peer when connecting as "<pid>/<uuid>,<uuid>.../<probe descriptor>" (a
        # process cannot open its own handles: peers in the same process stage).
        self._ipc = CudaIpc()
        self._ipc_peers: dict[int, frozenset[str]] = {}  # shm peer -> GPU UUIDs it opens our handles on
        self._ipc_refused: dict[int, str] = {}  # shm peer with GPUs -> why it cannot open our handles
        self._ipc_unusable: str | None = None  # why this process's tensors cannot be exported
        gpus = device_key() if c.cuda_ipc else ""
        self._device_key = f"{os.getpid()}/{gpus}/{self._ipc.probe()}" if gpus else ""
        if self._ipc.probe_error is not None:
            self._ipc_unusable = f"this process's CUDA memory cannot be shared by IPC handle: {self._ipc.probe_error}"
        cfg.device_key = self._device_key
        self._engine = _C.Engine(cfg)
        self._lock = threading.Lock()
        self.unsettled: dict[int, Handle] = {}  # whoever takes a handle out of it settles it
        # Outcomes a poll() took before the posting thread registered their handle, and handles
        # settled from there, reported by the next poll() (see _apply and _adopt).
        self._orphans: dict[int, tuple[int, int, str]] = {}
        self._late: list[Handle] = []
        self._pinned = PinnedPool()
        self._default_timeout = self._timeout_seconds(c.transfer_timeout)
        self._closed = False
        self._connected = False
        _OPEN.add(self)

    def _connect(self, addresses: list[str]) -> None:
        try:
            self._engine.connect(addresses, float(self._config.connect_timeout))
        except _C.PeerSetupError as e:
            self.close()
            message, peer = e.args
            raise PeerError(f"rank {self.rank}: endpoint setup failed: {message}", peer) from None
        except BaseException:
            self.close()
            raise
        self.addresses = tuple(addresses)
        self._connected = True
        self._plain_transfer, self._post_plain = self._engine.plain_transfer, self._engine.post_plain
        self.wait_done = self._engine.wait_done
        if self._device_key:
            try:
                self._agree_on_cuda_ipc()
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ posting

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *,
              timeout: float | None | ConfigDefault = DEFAULT) -> Handle:
        """Starts sending `tensor` to rank `dst`; the receiver matches it by (this rank, tag).

        Messages with the same (dst, tag) are received in posting order. Do not modify the
        tensor until the handle finished."""
        # The fast path (bindings.cpp, plain_cpu_tensor), written out here and in irecv, send,
        # recv and Handle.wait rather than shared through helpers: a helper call per message
        # measured 0.1-0.2 us more per one-way message here, against 1.2-2 us in all.
        post = self._post_plain
        if post is not None:
            seconds = self._default_timeout if timeout is DEFAULT else self._timeout_seconds(timeout)
            request_id = post(True, tensor, dst, tag, seconds)
            if request_id is not False:
                handle = self.unsettled[request_id] = Handle(self, request_id, "send", dst, tag, tensor, tensor)
                if self._orphans:  # another thread's poll() may have seen it finish first (see _apply)
                    self._adopt(handle)
                return handle
        self._check_open("isend")
        check_tensor(tensor, "isend")
        if tensor.is_cuda and dst in self._ipc_peers and tensor.numel():
            handle = self._post_device(tensor, dst, tag, timeout)
            if handle is not None:
                return handle
        wire = tensor
        if not tensor.is_cpu:
            wire = self._pinned.take(tensor.shape, tensor.dtype)
            wire.copy_(tensor)
        elif not tensor.is_contiguous():
            wire = tensor.contiguous()
        return self._post(True, tensor, wire, dst, tag, timeout)

    def irecv(self, out: torch.Tensor | tuple[Sequence[int], torch.dtype], src: int, tag: int, *,
              timeout: float | None | ConfigDefault = DEFAULT, device: torch.device | str | None = None) -> Handle:
        """Starts receiving from rank `src` into `out`, or into a new tensor when `out` is
        (shape, dtype) (allocated on `device`, default CPU). The sender's dtype and shape must
        match, else the handle fails with TensorMismatchError."""
        if isinstance(out, tuple):
            if len(out) != 2 or not isinstance(out[1], torch.dtype):
                raise ValueError("irecv(out=...) takes a tensor or a (shape, dtype) pair")
            try:
                out = torch.empty(tuple(int(s) for s in out[0]), dtype=out[1], device=device or "cpu")
            except (TypeError, RuntimeError) as e:
                raise ValueError(f"irecv: cannot allocate a tensor of shape {out[0]!r}: {e}") from None
        post = self._post_plain
        if post is not None:
            seconds = self._default_timeout if timeout is DEFAULT else self._timeout_seconds(timeout)
            request_id = post(False, out, src, tag, seconds)
            if request_id is not False:
                handle = self.unsettled[request_id] = Handle(self, request_id, "recv", src, tag, out, out)
                if self._orphans:
                    self._adopt(handle)
                return handle
        self._check_open("irecv")
        check_tensor(out, "irecv")
        if not out.is_contiguous():
            raise ValueError("irecv: the out tensor must be contiguous (or pass (shape, dtype) to allocate one)")
        wire = out if out.is_cpu else self._pinned.take(out.shape, out.dtype)
        return self._post(False, out, wire, src, tag, timeout)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *,
             timeout: float | None | ConfigDefault = DEFAULT) -> None:
        """Sends `tensor` and returns once it is sent: `isend(...).wait()` in a single call into
        the core, without a Handle. The lowest-latency way to send one small tensor. `timeout`
        is the transfer's own (see isend); it raises the transfer's error."""
        transfer = self._plain_transfer
        if transfer is not None:
            failed = transfer(True, tensor, dst, tag,
                              self._default_timeout if timeout is DEFAULT else self._timeout_seconds(timeout))
            if failed is None:
                return
            if failed is not False:
                raise error_for(failed[0], failed[1], dst)
        if type(tensor) is not torch.Tensor or not (tensor.is_cpu and tensor.is_contiguous()):
            self.isend(tensor, dst, tag, timeout=timeout).wait()
            return
        self._blocking(True, tensor, dst, tag, timeout, "send")

    def recv(self, out: torch.Tensor | tuple[Sequence[int], torch.dtype], src: int, tag: int, *,
             timeout: float | None | ConfigDefault = DEFAULT, device: torch.device | str | None = None) -> torch.Tensor:
        """Receives into `out` (or a new tensor for a (shape, dtype) pair) and returns it:
        `irecv(...).wait()` in a single call into the core, without a Handle."""
        transfer = self._plain_transfer
        if transfer is not None:
            failed = transfer(False, out, src, tag,
                              self._default_timeout if timeout is DEFAULT else self._timeout_seconds(timeout))
            if failed is None:
                return out
            if failed is not False:
                if failed[0] == DEVICE_COPY:
                    failed = self._copy_device_message(out, src, failed[1])
                    if failed is None:
                        return out
                raise error_for(failed[0], failed[1], src)
        if type(out) is not torch.Tensor or not (out.is_cpu and out.is_contiguous()):
            return self.irecv(out, src, tag, timeout=timeout, device=device).wait()
        self._blocking(False, out, src, tag, timeout, "recv")
        return out

    def _blocking(self, is_send: bool, tensor: torch.Tensor, peer: int, tag: int,
                  timeout: float | None | ConfigDefault, op: str) -> None:
        self._check_open(op)
        check_tensor(tensor, op)
        if type(peer) is not int:
            peer = check_int(peer, "dst" if is_send else "src")
        if type(tag) is not int:
            tag = check_int(tag, "tag")
        if not INT64_RANGE[0] <= tag <= INT64_RANGE[1]:
            raise ValueError(f"tag must fit in a signed 64-bit integer, got {tag}")
        _, state, kind, message = self._engine.transfer(
            is_send, tensor.data_ptr(), tensor.nbytes, dtype_code(tensor.dtype), list(tensor.shape), peer, tag,
            self._timeout_seconds(timeout))
        if state == DONE and kind == DEVICE_COPY:
            failed = self._copy_device_message(tensor, peer, message)
            if failed is None:
                return
            state, (kind, message) = FAILED, failed
        if state != DONE:
            raise error_for(kind, message, peer)

    def _post(self, is_send: bool, tensor: torch.Tensor, wire: torch.Tensor, peer: int, tag: int,
              timeout: float | None | ConfigDefault) -> Handle:
        peer, tag = check_int(peer, "dst" if is_send else "src"), check_int(tag, "tag")
        if not INT64_RANGE[0] <= tag <= INT64_RANGE[1]:
            raise ValueError(f"tag must fit in a signed 64-bit integer, got {tag}")
        seconds = self._timeout_seconds(timeout)
        post = self._engine.isend if is_send else self._engine.irecv
        nbytes = wire.nbytes
        # The lock makes registering the handle atomic with posting, so a completion reported
        # by another thread's poll() always finds its handle.
        with self._lock:
            request_id = post(wire.data_ptr(), nbytes, dtype_code(wire.dtype), list(wire.shape), peer, tag, seconds)
            handle = Handle(self, request_id, "send" if is_send else "recv", peer, tag, tensor, wire)
            self.unsettled[request_id] = handle
        return handle

    def _timeout_seconds(self, timeout: float | None | ConfigDefault) -> float:
        if timeout is DEFAULT:
            return self._default_timeout
        if timeout is None:
            return -1.0
        if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        return float(timeout)

    # ------------------------------------------------------------------ completion

    def poll(self, *, raise_errors: bool = True) -> list[Handle]:
        """Handles finished since the last poll()/wait_any() and not yet observed through
        their own test()/wait(). Each finished handle is reported once.

        With raise_errors, a failed handle raises its error (its `finished` attribute holds
        every handle of this batch, failed ones included)."""
        engine = self._engine
        if engine is None:  # closed: every handle was settled by close()
            return []
        with self._lock:
            batch = self._apply(engine.poll())
        return deliver_finished(batch, raise_errors)

    def wait_any(self, timeout: float | None = None, *, raise_errors: bool = True) -> list[Handle]:
        """Like poll(), but blocks without the GIL until at least one handle finished.
        Returns [] when `timeout` seconds pass first or nothing is in flight."""
        self._check_open("wait_any")
        engine = self._engine
        seconds = -1.0 if timeout is None else max(0.0, float(timeout))
        finished = engine.wait_any(seconds)
        with self._lock:
            batch = self._apply(finished)
        return deliver_finished(batch, raise_errors)

    def wait_all(self, handles: Iterable[Handle], timeout: float | None = None) -> None:
        """Waits for every handle; raises the first error, or TransferTimeout when the total
        `timeout` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in handles:
            h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    @property
    def in_flight(self) -> int:
        """Posted transfers that have not finished yet."""
        engine = getattr(self, "_engine", None)
        return engine.in_flight() if engine is not None else 0

    def transport(self, peer: int) -> str:
        """"shm", "verbs" or "tcp": how this endpoint reaches `peer` ("self" for its own rank)."""
        self._check_open("transport")
        return self._engine.transport_of(check_int(peer, "peer"))

    def copy_path(self, peer: int) -> str:
        """How messages above `eager_bytes` move to and from `peer` over shared memory: "single copy
        (cross-memory attach)", or "two copies through the ring (<why not single copy>)"; for
        other transports their name."""
        self._check_open("copy_path")
        return self._engine.copy_path(check_int(peer, "peer"))

    def stats(self) -> dict[str, int]:
        """Counters since the endpoint was built: transfers (sends and receives) finished, by how
        their bytes moved -- "eager" (whole with the header), "copied" (by the transport: the
        shared-memory ring, TCP, RDMA), "read" (single copy, the receiver read the sender's
        buffer), "written" (single copy, the sender wrote the receiver's buffer) -- and
        "device" (CUDA IPC: the receiver copied out of the sender's GPU memory), and "wakeups", the
        times this endpoint woke a peer's receive thread (a system call each)."""
        self._check_open("stats")
        return dict(self._engine.stats())

    def _apply(self, finished: list[tuple[int, int, int, str]]) -> list[Handle]:
        """Settles what the core reported finished (lock held). The fast paths of isend/irecv
        register a handle right after posting, without the lock (it cost 0.1 us a message), so
        a poll() in another thread can see a request finish before its handle exists. Its
        outcome is then left in _orphans for the posting thread to adopt; whichever of the two
        takes it out of _orphans settles the handle (both steps are atomic under the GIL)."""
        out = []
        for request_id, state, kind, message in finished:
            handle = self.unsettled.get(request_id)
            if handle is None:
                self._orphans[request_id] = (state, kind, message)
                handle = self.unsettled.get(request_id)  # registered meanwhile?
                if handle is None or self._orphans.pop(request_id, None) is None:
                    continue
            self._settle(handle, state, kind, message)
            out.append(handle)
        if self._late:
            out, self._late = self._late + out, []
        return out

    def _adopt(self, handle: Handle) -> None:
        """The posting thread's half of _apply's hand-over."""
        with self._lock:
            outcome = self._orphans.pop(handle.id, None)
            if outcome is not None:
                self._settle(handle, *outcome)
                self._late.append(handle)

    def _settle(self, handle: Handle, state: int, kind: int, message: str) -> None:
        """Records the outcome and lets go of the memory (called with the lock held)."""
        if self.unsettled.pop(handle.id, None) is None:
            return  # already settled by whoever took it out of the table first (Handle.wait's short way)
        if state == DONE and kind == DEVICE_COPY:  # a receive from a peer's GPU memory
            failed = self._copy_device_message(handle.tensor, handle.peer, message)
            if failed is not None:
                state, (kind, message) = FAILED, failed
        if state == FAILED:
            staging = handle.settle(FAILED, error_for(kind, message, handle.peer), False)
        else:  # a device copy landed in the tensor itself; a staged receive is copied out
            staging = handle.settle(state, None, kind != DEVICE_COPY)
        if staging is not None and staging.is_cpu:
            self._pinned.give(staging)

    # ------------------------------------------------------------------ Completer (for Handles)

    def refresh(self, handle: Handle) -> None:
        """Settles `handle` if the core has finished its request (without waiting)."""
        with self._lock:
            engine = getattr(self, "_engine", None)
            if not handle.settled and engine is not None:
                request_id, state, kind, message = engine.release(handle.id)
                if state in (DONE, FAILED):
                    self._settle(handle, state, kind, message)

    def wait_for(self, handle: Handle, timeout: float | None, taken: Outcome | None = None) -> None:
        """Settles `handle`: with `taken`, an outcome the calling thread already took from the
        core, when that is final, else by waiting at most `timeout` seconds (None: no limit) for
        the core; raises TransferTimeout naming the peer when the request is unfinished then."""
        if taken is not None:
            with self._lock:
                if not handle.settled and taken[1] in (DONE, FAILED):
                    self._settle(handle, taken[1], taken[2], taken[3])
            if handle.settled:
                return
        seconds = -1.0 if timeout is None else max(0.0, float(timeout))
        deadline = None if timeout is None else time.monotonic() + seconds
        engine = self._engine
        if engine is None:
            raise EndpointClosedError(f"rank {self.rank}: endpoint closed", handle.peer)
        request_id, state, kind, message = engine.wait_take(handle.id, seconds)
        finished = state != PENDING
        if state in (DONE, FAILED):
            with self._lock:
                if not handle.settled:
                    self._settle(handle, state, kind, message)
        else:
            self.refresh(handle)
        # Another thread's poll() may have taken the outcome and be about to record it.
        while not handle.settled and finished:
            if deadline is not None and time.monotonic() > deadline + 1.0:
                break
            time.sleep(0)
            self.refresh(handle)
        if not handle.settled:
            detail = self._engine.describe(handle.id)
            raise TransferTimeout(f"rank {self.rank}: {detail}; not finished after waiting {timeout} s "
                                  f"for peer rank {handle.peer}", handle.peer)

    # ------------------------------------------------------------------ lifetime

    def _check_open(self, op: str) -> None:
        if self._closed or self._engine is None:
            raise EndpointClosedError(f"{op}: endpoint of rank {self.rank} is closed")
        if not self._connected:
            raise TransportError(f"{op}: endpoint of rank {self.rank} is not connected")

    def close(self, grace: float = 2.0) -> None:
        """Fails what is still in flight, says goodbye to the peers (waiting at most `grace`
        seconds for them to notice) and stops the threads. Idempotent."""
        engine = getattr(self, "_engine", None)
        self._closed = True
        self._plain_transfer = self._post_plain = self.wait_done = None
        if engine is None:
            return
        engine.close(float(grace))
        with self._lock:
            self._apply(engine.poll())
            for handle in list(self.unsettled.values()):
                self._settle(handle, FAILED, 4, f"rank {self.rank}: endpoint closed")
        self._engine = None
        self._ipc.close()
        _OPEN.discard(self)

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(grace=0.5)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Endpoint(job_id={self.job_id!r}, rank={self.rank}, world_size={self.world_size}, {state})"


# Endpoints still open at interpreter exit are closed, so peers see a goodbye, not a crash.
_OPEN: "weakref.WeakSet[Endpoint]" = weakref.WeakSet()


@atexit.register
def _close_open_endpoints() -> None:
    for endpoint in list(_OPEN):
        try:
            endpoint.close(grace=1.0)
        except Exception:
            pass
