"""MegaDPP settings: the policy, the activation-memory budget (a count or a size such as 64MB,
converted with an estimate of one stored activation) and the transport, validated up front."""
from __future__ import annotations

import re
from dataclasses import dataclass

from megatron.app.config import ConfigError
from megatron.app.schedule import PipelineLayout

from .policy import POLICY_NAMES, default_budget, minimum_budget, static_peak_activations

TRANSPORTS = ("shm", "torch")
_UNITS = {"": None, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_quantity(text: str) -> tuple[float, int | None]:
    """'4' -> (4, None); '64MB', '256K', '1.5GiB' -> (value, bytes per unit). ValueError otherwise."""
    match = _QUANTITY.fullmatch(text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(text)
    return float(match.group(1)), _UNITS[unit]


@dataclass(kw_only=True, slots=True)
class DppConfig:
    policy: str = "adaptive"
    budget: int | None = None  # stored (chunk, microbatch) activations per rank; None: unbounded
    transport: str = "shm"
    workload_bytes: int = 256 << 10
    num_gpus: int | None = None  # ranks per node (multi-node placement)
    node_ips: tuple[str, ...] = ()
    multi_node: bool = False


def activation_bytes(*, seq_length: int, micro_batch_size: int, hidden_size: int, num_attention_heads: int,
                     layers_per_chunk: int, element_size: int, tensor_parallel: int = 1) -> int:
    """Estimate of what autograd keeps for one chunk on one microbatch: per transformer layer about
    17 tensors of [seq, batch, hidden] (inputs of the norms, projections, MLP and dropout masks) plus
    the attention scores and probabilities, [batch, heads, seq, seq] twice and a byte mask."""
    tokens = seq_length * micro_batch_size
    per_layer = 17 * tokens * hidden_size * element_size
    per_layer += micro_batch_size * num_attention_heads * seq_length * seq_length * (2 * element_size + 1)
    return max(1, layers_per_chunk * per_layer // max(1, tensor_parallel))


def parse_budget(text: str | None, *, policy: str, layout: PipelineLayout, bytes_per_activation: int) -> int | None:
    """`--dpp-memory-budget` as a count of stored activations per rank. A bare number counts
    activations ((chunk, microbatch) pairs; microbatches when there is one chunk); a size such as
    64MB is divided by `bytes_per_activation`. None picks the policy's default."""
    if text is None or text.strip() == "":
        return default_budget(policy, layout)
    try:
        value, unit_bytes = parse_quantity(text)
    except ValueError:
        raise ConfigError(f"--dpp-memory-budget {text!r}: expected a count of stored activations (e.g. 4) "
                          f"or a size with a unit KB, MB or GB (e.g. 64MB)") from None
    if unit_bytes is None:
        if value != int(value):
            raise ConfigError(f"--dpp-memory-budget {text!r}: a count of activations must be a whole number")
        count, described = int(value), f"{int(value)} activations"
    else:
        count = int(value * unit_bytes // bytes_per_activation)
        described = (f"{text.strip()} = {count} activations of ~{bytes_per_activation / (1 << 20):.2f} MiB "
                     f"(estimated per chunk and microbatch)")
    need = minimum_budget(layout)
    if count < need:
        raise ConfigError(
            f"--dpp-memory-budget {described} is below what any schedule needs: {need} per rank "
            f"(each microbatch stores one activation on each of the {layout.num_chunks} chunk(s) of a rank "
            f"before its first backward); static 1F1B stores {static_peak_activations(layout)} on rank 0")
    return min(count, layout.num_chunks * layout.num_microbatches)


def check_transport(name: str, device: str) -> None:
    """ConfigError unless the transport can run here."""
    if name not in TRANSPORTS:
        raise ConfigError(f"--dpp-transport {name!r}: choose one of {', '.join(TRANSPORTS)}")
    if name == "shm":
        try:
            from megatron.shm_tensor_rdma import _C  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                "--dpp-transport shm needs the shm_tensor_rdma C++ extension, which is not built "
                f"({exc}): build it with `pip install -e .` or run with --dpp-transport torch") from None
    if name == "torch" and device == "cuda":
        raise ConfigError("--dpp-transport torch needs tag-matched P2P (gloo), but CUDA runs use NCCL, which "
                          "matches messages by posting order that a dynamic schedule does not keep: "
                          "use --dpp-transport shm")


def check_policy(name: str) -> None:
    if name not in POLICY_NAMES:
        raise ConfigError(f"--dpp-policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")
