"""Argument checks shared by the endpoint's calls (each raises ValueError saying what to change),
and DEFAULT, the timeout that means "the configured one"."""
from __future__ import annotations

import torch

INT64_RANGE = (-(2**63), 2**63 - 1)  # what a tag may be


class ConfigDefault:
    """The type of DEFAULT: a timeout argument left to EndpointConfig.transfer_timeout."""

    def __repr__(self) -> str:
        return "<config default>"


DEFAULT = ConfigDefault()


def check_rank_args(rank: int, world_size: int) -> None:
    """`rank` and `world_size` are ints with 0 <= rank < world_size."""
    world_size = check_int(world_size, "world_size")
    rank = check_int(rank, "rank")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def check_int(value: object, name: str) -> int:
    """`value` as an int (a NumPy integer is accepted; a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                return int(value)
        except ImportError:  # pragma: no cover
            pass
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def check_tensor(tensor: object, op: str) -> None:
    """`tensor` is a dense CPU or CUDA torch.Tensor of at most 32 dimensions."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{op}: only dense (strided) tensors are supported, got layout {tensor.layout}")
    if not (tensor.is_cpu or tensor.is_cuda):
        raise ValueError(f"{op}: tensors must be on CPU or CUDA, got device {tensor.device}")
    if tensor.dim() > 32:
        raise ValueError(f"{op}: tensors with more than 32 dimensions are not supported")


def port_of(address: str, rank: int) -> int:
    """The port of peer_addresses[rank], a "host:port" string."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer_addresses[{rank}] must look like 'host:port' with a port in 1..65535, "
                         f"got {address!r}")
    return int(port)
