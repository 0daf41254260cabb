"""CUDA tensors between processes of one host by IPC handle: the connect-time agreement on which
peers can open this process's handles, the device send, the receiver's copy out of the sender's
GPU memory, and `device_path` saying which way CUDA tensors go to a peer. A part of Endpoint
(its base class); the CUDA calls themselves are in cuda_ipc.py."""
from __future__ import annotations

import os
import warnings

import torch

from . import _C
from .checks import INT64_RANGE, ConfigDefault, check_int
from .dtypes import dtype_code
from .handle import Handle

DEVICE_COPY = 6  # a finished receive whose bytes wait in the sender's GPU memory (ErrorKind::DeviceCopy)
# The one tag the library uses itself: while connecting, same-host peers with GPUs tell each other
# whether they could open the other's CUDA IPC probe handle (a _PROBE_BYTES message: why not, or empty).
PROBE_TAG = -(2**63)
_PROBE_BYTES = 512


class DeviceTransfers:
    """Endpoint's CUDA IPC methods (they use its engine, lock, handles and configuration)."""

    def _agree_on_cuda_ipc(self) -> None:
        """Every same-host peer (in another process) with GPUs tries to open this process's probe
        handle, and tells whether it could; CUDA tensors go by handle only to the peers that could."""
        candidates: dict[int, tuple[frozenset[str], str]] = {}
        for peer in range(self.world_size):
            if peer == self.rank or self._engine.transport_of(peer) != "shm":
                continue
            pid, _, rest = self._engine.peer_device_key(peer).partition("/")
            gpus, _, probe = rest.partition("/")
            if gpus and pid != str(os.getpid()):
                candidates[peer] = (frozenset(gpus.split(",")), probe)
        sends, answers = [], {}
        for peer, (_, probe) in candidates.items():
            why = self._ipc.try_open(probe) if probe else "that process made no IPC handle"
            text = (why or "").encode()[:_PROBE_BYTES]
            message = torch.zeros(_PROBE_BYTES, dtype=torch.uint8)
            message[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
            sends.append(self.isend(message, peer, PROBE_TAG))
            answers[peer] = self.irecv(((_PROBE_BYTES,), torch.uint8), peer, PROBE_TAG)
        self.wait_all(sends + list(answers.values()), timeout=self._config.connect_timeout)
        for peer, answer in answers.items():
            why = bytes(answer.tensor.tolist()).rstrip(b"\0").decode(errors="replace")
            if why:
                self._ipc_refused[peer] = why
            else:
                self._ipc_peers[peer] = candidates[peer][0]
        self._ipc.drop_probe()

    def _post_device(self, tensor: torch.Tensor, dst: int, tag: int,
                     timeout: float | None | ConfigDefault) -> Handle | None:
        """Sends a CUDA tensor by IPC handle (None: stage it through host memory instead)."""
        if self._ipc_unusable is not None:
            return None
        dst, tag = check_int(dst, "dst"), check_int(tag, "tag")
        if not INT64_RANGE[0] <= tag <= INT64_RANGE[1]:
            raise ValueError(f"tag must fit in a signed 64-bit integer, got {tag}")
        seconds = self._timeout_seconds(timeout)
        source = tensor if tensor.is_contiguous() else tensor.contiguous()
        if self._ipc.uuid_of(source) not in self._ipc_peers[dst]:
            return None  # the peer does not see this GPU
        try:
            descriptor = self._ipc.export(source)
        except RuntimeError as e:
            self._ipc_unusable = str(e)
            warnings.warn(f"shm_tensor_rdma rank {self.rank}: CUDA tensors are staged through host memory from "
                          f"now on, because their memory cannot be shared by IPC handle: {e}", RuntimeWarning,
                          stacklevel=3)
            return None
        with self._lock:
            request_id = self._engine.isend_device(descriptor, source.nbytes, dtype_code(source.dtype),
                                                   list(source.shape), dst, tag, seconds)
            handle = self.unsettled[request_id] = Handle(self, request_id, "send", dst, tag, tensor, source)
        return handle

    def _copy_device_message(self, out: torch.Tensor, peer: int, message: str) -> tuple[int, str] | None:
        """Copies a message out of the sender's GPU memory into `out` and tells the sender
        (its request finishes then). None when done, else (error kind, message)."""
        send_id, descriptor = message.split(" ", 1)
        engine = self._engine
        try:
            self._ipc.copy_in(descriptor, out)
        except Exception as e:  # noqa: BLE001 - any failure fails both sides, with its text
            reason = f"CUDA IPC copy from rank {peer} failed: {e}"
            if engine is not None:
                try:
                    engine.device_done(peer, int(send_id), False, reason)
                except (_C.TransportError, ValueError):
                    pass
            return 5, (f"rank {self.rank}: {reason}; EndpointConfig(cuda_ipc=False) on the sending rank "
                       f"stages its CUDA tensors through host memory instead")
        if engine is not None:
            try:
                engine.device_done(peer, int(send_id), True, "")
            except _C.TransportError:
                pass  # closed meanwhile: the peer sees the goodbye
        return None

    def device_path(self, peer: int) -> str:
        """How CUDA tensors move to `peer`: "CUDA IPC" (device to device, no host copy) or
        "host staging (<why not IPC>)"."""
        self._check_open("device_path")
        peer = check_int(peer, "peer")
        if peer in self._ipc_peers and self._ipc_unusable is None:
            return "CUDA IPC"
        if not self._config.cuda_ipc:
            why = "cuda_ipc=False here"
        elif not self._device_key:
            why = ("no GPU visible here" if not torch.cuda.is_available() else
                   "CUDA was not initialized in this process when the endpoint was created; "
                   "call torch.cuda.set_device first")
        elif self._ipc_unusable is not None:
            why = self._ipc_unusable
        elif peer in self._ipc_refused:
            why = f"rank {peer} cannot open this process's CUDA IPC handles: {self._ipc_refused[peer]}"
        elif self.transport(peer) != "shm":
            why = f"rank {peer} is reached over {self.transport(peer)}"
        elif self._engine.peer_device_key(peer).partition("/")[0] == str(os.getpid()):
            why = f"rank {peer} is an endpoint of this process"
        else:
            why = f"rank {peer} sees no GPU or has cuda_ipc=False"
        return f"host staging ({why})"
