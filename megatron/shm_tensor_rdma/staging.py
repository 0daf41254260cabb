"""Pinned host buffers for CUDA tensors: the C++ core moves host memory only, so a CUDA
tensor is copied once into a pinned buffer before sending and once out after receiving."""
from __future__ import annotations

import threading
from collections import defaultdict

import torch


class PinnedPool:
    """Reuses pinned buffers by size; pinning is expensive (a page-locking syscall per call)."""

    def __init__(self, max_cached_bytes: int = 1 << 30) -> None:
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._cached = 0
        self._max = max_cached_bytes
        self._lock = threading.Lock()

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            free = self._free.get(nbytes)
            raw = free.pop() if free else None
            if raw is not None:
                self._cached -= nbytes
        if raw is None:
            raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)

    def give(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        if not nbytes or not buffer.is_pinned():
            return
        raw = buffer.view(-1).view(torch.uint8)
        with self._lock:
            if self._cached + nbytes <= self._max:
                self._free[nbytes].append(raw)
                self._cached += nbytes
