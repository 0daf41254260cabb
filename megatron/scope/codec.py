"""Binary frames and server-side reduction: float16 arrays behind a small JSON header.

Frame layout: b"MSC1", uint32 little-endian header length, UTF-8 JSON header, zero padding
to a multiple of 8, then the arrays, each 8-byte aligned so the browser can view them in place.
"""
from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch

MAGIC = b"MSC1"
# The client picks from these menus; anything else is rejected, so no client text is ever
# turned into code or an arbitrary shape.
BIN_CHOICES: tuple[int, ...] = (0, 8, 16, 32, 64, 128, 256)  # 0 = the full hidden dimension
REDUCE_CHOICES: tuple[str, ...] = ("mean", "max", "absmax")
_DTYPES = {"f16": np.float16, "f32": np.float32, "i32": np.int32}


class FrameError(ValueError):
    """A binary frame is truncated or its header does not describe its payload."""


def reduce_bins(values: torch.Tensor, bins: int, how: str) -> torch.Tensor:
    """Reduce the last dimension to `bins` contiguous groups (sizes differ by at most one)."""
    if how not in REDUCE_CHOICES:
        raise ValueError(f"reduction {how!r} is not one of {REDUCE_CHOICES}")
    width = values.shape[-1]
    if bins <= 0 or bins >= width:
        return values
    if width % bins == 0:
        grouped = values.reshape(*values.shape[:-1], bins, width // bins)
        return _reduce_last(grouped, how)
    parts = torch.tensor_split(values, bins, dim=-1)
    return torch.stack([_reduce_last(part, how) for part in parts], dim=-1)


def _reduce_last(values: torch.Tensor, how: str) -> torch.Tensor:
    if how == "mean":
        return values.mean(dim=-1)
    if how == "max":
        return values.amax(dim=-1)
    return values.abs().amax(dim=-1)


def encode_frame(header: dict[str, Any], arrays: dict[str, np.ndarray | torch.Tensor]) -> bytes:
    """One binary frame; float arrays travel as float16, integer arrays as int32."""
    entries = []
    blobs = []
    offset = 0
    for name, array in arrays.items():
        if isinstance(array, torch.Tensor):
            array = array.detach().cpu().numpy()
        if np.issubdtype(array.dtype, np.integer):
            data, dtype = np.ascontiguousarray(array, dtype=np.int32), "i32"
        else:
            # float16 tops out at 65504: clip so a blown-up activation shows as saturated, not inf.
            data = np.clip(np.nan_to_num(array.astype(np.float32), nan=0.0), -65504, 65504)
            data, dtype = np.ascontiguousarray(data, dtype=np.float16), "f16"
        raw = data.tobytes()
        entries.append({"name": name, "dtype": dtype, "shape": list(data.shape), "offset": offset})
        pad = (-len(raw)) % 8
        blobs.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    full = dict(header, arrays=entries)
    text = json.dumps(full, separators=(",", ":")).encode()
    head_pad = (-(len(MAGIC) + 4 + len(text))) % 8
    return MAGIC + struct.pack("<I", len(text)) + text + b" " * head_pad + b"".join(blobs)


def decode_frame(frame: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of encode_frame (used by tests and Python clients)."""
    if len(frame) < 8 or frame[:4] != MAGIC:
        raise FrameError("not a MegaScope frame (bad magic)")
    (length,) = struct.unpack("<I", frame[4:8])
    if 8 + length > len(frame):
        raise FrameError(f"header of {length} bytes runs past the {len(frame)}-byte frame")
    header = json.loads(frame[8:8 + length].decode())
    start = 8 + length + ((-(8 + length)) % 8)
    arrays = {}
    for entry in header.get("arrays", []):
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        count = int(np.prod(entry["shape"])) if entry["shape"] else 1
        begin = start + entry["offset"]
        end = begin + count * dtype.itemsize
        if end > len(frame):
            raise FrameError(f"array {entry['name']} runs past the end of the frame")
        arrays[entry["name"]] = np.frombuffer(frame[begin:end], dtype=dtype).reshape(entry["shape"])
    return header, arrays
