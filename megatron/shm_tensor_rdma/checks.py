"""Argument checks shared by the endpoint's calls: each raises ValueError saying what to change."""
from __future__ import annotations

import torch

_INT64 = (-(2**63), 2**63 - 1)


def _check_rank_args(rank: int, world_size: int) -> None:
    world_size = _check_int(world_size, "world_size")
    rank = _check_int(rank, "rank")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def _check_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                return int(value)
        except ImportError:  # pragma: no cover
            pass
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def _check_tensor(tensor, op: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{op}: only dense (strided) tensors are supported, got layout {tensor.layout}")
    if not (tensor.is_cpu or tensor.is_cuda):
        raise ValueError(f"{op}: tensors must be on CPU or CUDA, got device {tensor.device}")
    if tensor.dim() > 32:
        raise ValueError(f"{op}: tensors with more than 32 dimensions are not supported")


def _port_of(address: str, rank: int) -> int:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer_addresses[{rank}] must look like 'host:port' with a port in 1..65535, "
                         f"got {address!r}")
    return int(port)
