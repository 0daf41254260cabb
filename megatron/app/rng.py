"""The RNG state a forward pass draws from, packed into one byte tensor: the CPU generator, the
CUDA one when present, and every stream of megatron-core's RNG tracker (dropout in tensor-parallel
regions). A recomputation that restores it draws exactly what the first forward drew, on another
rank as well (MegaFBD's backward instances)."""
from __future__ import annotations

import torch


def _tracker_states() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel import random as mc_random

    tracker = mc_random.get_cuda_rng_tracker()
    return tracker.get_states() if getattr(tracker, "is_initialized", lambda: False)() else {}


def rng_snapshot() -> torch.Tensor:
    """CPU generator state, the CUDA one when present, and every RNG tracker stream, as uint8."""
    parts = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(torch.cuda.get_rng_state())
    states = _tracker_states()
    parts += [states[name].cpu() for name in sorted(states)]
    return torch.cat([p.view(torch.uint8).flatten() for p in parts])


def rng_restore(packed: torch.Tensor) -> None:
    """Inverse of rng_snapshot on a process with the same generators."""
    from megatron.core.tensor_parallel import random as mc_random

    offset = 0

    def take(like: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        part = packed[offset: offset + like.numel()].clone()
        offset += like.numel()
        return part

    torch.set_rng_state(take(torch.get_rng_state()))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(take(torch.cuda.get_rng_state()))
    states = _tracker_states()
    if states:
        mc_random.get_cuda_rng_tracker().set_states({name: take(states[name]) for name in sorted(states)})
    if offset != packed.numel():
        raise RuntimeError(f"RNG state of {packed.numel()} bytes does not match this process's {offset}")
