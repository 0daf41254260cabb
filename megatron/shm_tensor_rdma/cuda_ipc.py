"""CUDA tensors between processes of one host through CUDA IPC handles, with no host staging.

The sender describes where its tensor lies (an IPC handle of the allocation, the offset into
it, the GPU's UUID) in a short text that travels in a DeviceRts message; the receiver's process
opens the handle once per allocation, copies straight out of the sender's GPU memory into its
own tensor (a device-to-device copy, or device-to-host for a host buffer) and answers, which
finishes the sender's request. The C++ core never touches GPU memory: these calls run in the
two processes' Python callers.

The CUDA runtime and driver are reached through ctypes, in the copies that PyTorch loaded, so
the extension builds and runs on machines without CUDA.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections import OrderedDict

import torch

_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_MEMCPY_DEFAULT = 4               # cudaMemcpyDefault: direction from the unified address space
_POINTER_BUFFER_ID = 7            # CU_POINTER_ATTRIBUTE_BUFFER_ID: unique per allocation
_OPEN_LIMIT = 64                  # handles a receiver keeps open (least recently used closed first)


class _IpcHandle(ctypes.Structure):
    # Unsigned bytes, not c_char: a c_char array field reads back only up to its first zero byte.
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def handle_hex(handle: _IpcHandle) -> str:
    """The 64 bytes of a cudaIpcMemHandle_t as text (zero bytes included)."""
    return bytes(handle.reserved).hex()


def handle_from_hex(text: str) -> _IpcHandle:
    raw = bytes.fromhex(text)
    if len(raw) != 64:
        raise ValueError(f"a CUDA IPC handle has 64 bytes, the descriptor carries {len(raw)}")
    return _IpcHandle.from_buffer_copy(raw)


def _loaded_library(stem: str) -> str | None:
    """The path of a shared library already mapped into this process (the one PyTorch uses)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if f"/{stem}.so" in path:
                    return path
    except OSError:
        pass
    return None


class _Cuda:
    """The few runtime and driver entry points IPC needs, bound once."""

    def __init__(self) -> None:
        torch.cuda.init()
        path = _loaded_library("libcudart") or ctypes.util.find_library("cudart")
        if path is None:
            raise RuntimeError("CUDA IPC: the CUDA runtime library (libcudart) is not loaded or found")
        rt = ctypes.CDLL(path)
        drv = ctypes.CDLL(_loaded_library("libcuda") or "libcuda.so.1")
        self.rt, self.drv = rt, drv
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
        rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        rt.cudaFree.argtypes = [ctypes.c_void_p]
        get_range = getattr(drv, "cuMemGetAddressRange_v2", None) or drv.cuMemGetAddressRange
        get_range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self.get_range = get_range
        drv.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]

    def check(self, code: int, what: str) -> None:
        if code != 0:
            text = self.rt.cudaGetErrorString(code)
            raise RuntimeError(f"{what} failed: {text.decode() if text else 'CUDA error'} ({code})")

    def check_driver(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: CUDA driver error {code}")


def device_key() -> str:
    """UUIDs of the GPUs this process sees, comma-separated; "" without CUDA, and also while this
    process has not initialized CUDA itself (set its device): an endpoint never creates a CUDA
    context of its own, which would take memory on a GPU the process may not mean to use."""
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return ""
        return ",".join(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))
    except (RuntimeError, AssertionError):  # a driver that fails to initialize: no IPC
        return ""


def _device_of(tensor: torch.Tensor) -> int:
    return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()


class CudaIpc:
    """One endpoint's exports (sender side) and opened handles (receiver side)."""

    def __init__(self) -> None:
        self._cuda: _Cuda | None = None
        self._lock = threading.Lock()
        self._uuids: list[str] | None = None
        self._exported: dict[tuple[int, int], tuple[int, str]] = {}  # (device, buffer id) -> (base, handle hex)
        # (uuid, handle hex) -> (mapped base, device index)
        self._opened: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        self._probe: torch.Tensor | None = None
        self.probe_error: str | None = None  # why probe() made no descriptor

    def _lib(self) -> _Cuda:
        if self._cuda is None:
            self._cuda = _Cuda()
        return self._cuda

    def uuid_of(self, tensor: torch.Tensor) -> str:
        """The UUID of the GPU holding `tensor`."""
        if self._uuids is None:
            self._uuids = device_key().split(",")
        return self._uuids[_device_of(tensor)]

    def export(self, tensor: torch.Tensor) -> str:
        """The descriptor of a contiguous CUDA tensor, once the work queued on its device's current
        stream (which produced it) finished, so the receiver reads the final bytes."""
        cuda = self._lib()
        device = _device_of(tensor)
        pointer = tensor.data_ptr()
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()
            cuda.check(cuda.rt.cudaFree(None), "cudaFree(0) (binding the device's context)")
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            cuda.check_driver(cuda.get_range(ctypes.byref(base), ctypes.byref(size), pointer), "cuMemGetAddressRange")
            buffer_id = ctypes.c_uint64()
            cuda.check_driver(cuda.drv.cuPointerGetAttribute(ctypes.byref(buffer_id), _POINTER_BUFFER_ID, pointer),
                              "cuPointerGetAttribute(BUFFER_ID)")
            key = (device, buffer_id.value)
            with self._lock:
                known = self._exported.get(key)
            if known is None or known[0] != base.value:
                handle = _IpcHandle()
                cuda.check(cuda.rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base.value)),
                           "cudaIpcGetMemHandle")
                known = (base.value, handle_hex(handle))
                with self._lock:
                    if len(self._exported) >= 4 * _OPEN_LIMIT:
                        self._exported.clear()
                    self._exported[key] = known
        return f"{self.uuid_of(tensor)} {known[1]} {pointer - base.value}"

    def copy_in(self, descriptor: str, out: torch.Tensor) -> None:
        """Copies the described bytes into `out` (contiguous, CUDA or host) and waits until the
        copy finished, so the sender may reuse its memory once told."""
        cuda = self._lib()
        uuid, handle_text, offset = descriptor.split(" ")
        try:
            device = self._device_index(uuid)
        except ValueError:
            raise RuntimeError(f"the sender's GPU {uuid} is not visible to this process "
                               f"(CUDA_VISIBLE_DEVICES); its tensor cannot be opened here") from None
        nbytes = out.numel() * out.element_size()
        with torch.cuda.device(device):
            base = self._open(cuda, uuid, handle_text, device)
            stream = torch.cuda.current_stream(out.device if out.is_cuda else device)
            cuda.check(cuda.rt.cudaMemcpyAsync(ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(base + int(offset)),
                                               nbytes, _MEMCPY_DEFAULT, ctypes.c_void_p(stream.cuda_stream)),
                       "cudaMemcpyAsync from the sender's GPU memory")
            stream.synchronize()

    def probe(self) -> str:
        """The descriptor of a small buffer on this process's current GPU, which peers try to open
        while connecting; "" (and `probe_error` set) when this process cannot export one."""
        try:
            self._probe = torch.zeros(1, dtype=torch.uint8, device=torch.cuda.current_device())
            return self.export(self._probe)
        except (RuntimeError, OSError, AttributeError) as e:
            self._probe, self.probe_error = None, str(e)
            return ""

    def try_open(self, descriptor: str) -> str | None:
        """None when a peer's probe descriptor opens in this process, else why it does not."""
        uuid, handle_text, _ = descriptor.split(" ")
        try:
            device = self._device_index(uuid)
        except ValueError:
            return f"the GPU {uuid} is not visible to that process (CUDA_VISIBLE_DEVICES)"
        try:
            with torch.cuda.device(device):
                self._open(self._lib(), uuid, handle_text, device)
        except (RuntimeError, OSError, ValueError) as e:
            return str(e)
        return None

    def drop_probe(self) -> None:
        self._probe = None

    def _device_index(self, uuid: str) -> int:
        if self._uuids is None:
            self._uuids = device_key().split(",")
        return self._uuids.index(uuid)

    def _open(self, cuda: _Cuda, uuid: str, handle_text: str, device: int) -> int:
        key = (uuid, handle_text)
        with self._lock:
            known = self._opened.get(key)
            if known is not None:
                self._opened.move_to_end(key)
                return known[0]
        handle = handle_from_hex(handle_text)
        mapped = ctypes.c_void_p()
        cuda.check(cuda.rt.cudaIpcOpenMemHandle(ctypes.byref(mapped), handle, _IPC_LAZY_ENABLE_PEER_ACCESS),
                   "cudaIpcOpenMemHandle")
        evicted = []
        with self._lock:
            self._opened[key] = (mapped.value, device)
            while len(self._opened) > _OPEN_LIMIT:
                evicted.append(self._opened.popitem(last=False)[1])
        self._unmap(evicted)  # every copy out of them was waited for
        return mapped.value

    def _unmap(self, mappings: list[tuple[int, int]]) -> None:
        for base, device in mappings:
            with torch.cuda.device(device):
                self._lib().rt.cudaIpcCloseMemHandle(ctypes.c_void_p(base))

    def close(self) -> None:
        """Unmaps every opened handle (copies out of them were all waited for)."""
        with self._lock:
            opened, self._opened = list(self._opened.values()), OrderedDict()
            self._exported.clear()
        if opened:
            try:
                self._unmap(opened)
            except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be torn down
                pass
