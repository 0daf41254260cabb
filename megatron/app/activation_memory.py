"""What the pipeline executor keeps for backward, in bytes: each stored forward's saved tensors
(counted once per storage, parameters left out) and each pending weight-gradient task's tensors
(megatron.app.weight_grad). `ActivationMeter.peak` is the most this rank held at once; the
executor reports it with `--report-activation-memory`. Counting goes through autograd's
saved-tensor hooks, which hand every tensor back unchanged."""
from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator

import torch

__all__ = ["ActivationMeter", "report_peak"]


class ActivationMeter:
    """Bytes held per key (a (chunk, microbatch) of the running iteration) and their peak."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._held: dict[Hashable, int] = {}
        self.current = 0
        self.peak = 0

    @contextlib.contextmanager
    def forward(self, key: Hashable) -> Iterator[None]:
        """Counts what autograd saves while the block runs as `key`'s."""
        seen: set[int] = set()
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer not in seen and pointer not in self._parameter_storages:
                seen.add(pointer)
                total += storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.hold(key, total)

    def hold(self, key: Hashable, nbytes: int) -> None:
        """`key` now holds `nbytes` (replacing what it held)."""
        self.current += nbytes - self._held.get(key, 0)
        self._held[key] = nbytes
        self.peak = max(self.peak, self.current)

    def release(self, key: Hashable) -> None:
        self.current -= self._held.pop(key, 0)

    def clear(self) -> None:
        self._held.clear()
        self.current = 0


def report_peak(executor, rank: int, pp_rank: int) -> None:
    """--report-activation-memory: print this rank's peak of what its executor kept for backward."""
    meter = getattr(executor, "memory", None)
    if meter is None:
        print(f"[rank {rank}] activation memory: not measured by this executor", flush=True)
        return
    print(f"[rank {rank}] pp rank {pp_rank}: peak activation memory {meter.peak / 2**20:.2f} MiB "
          f"({meter.peak} bytes kept for backward), peak stored activations "
          f"{executor.peak_stored_activations}", flush=True)
