"""Stable numeric codes for torch dtypes, so both ends can check they agree on a message.

Bytes are moved, never converted: the code only serves the mismatch check and its message.
"""
from __future__ import annotations

import zlib

import torch

# Order is part of the wire format: append only.
_KNOWN = (
    "float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64", "bool",
    "complex64", "complex128", "complex32", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "qint8", "quint8", "qint32", "quint4x2",
)
_CODES: dict[torch.dtype, int] = {}
for _index, _name in enumerate(_KNOWN, start=1):
    _dtype = getattr(torch, _name, None)
    if isinstance(_dtype, torch.dtype):
        _CODES[_dtype] = _index


def dtype_code(dtype: torch.dtype) -> int:
    """Code of `dtype`; dtypes not in the table get a hash of their name (above the table)."""
    code = _CODES.get(dtype)
    if code is not None:
        return code
    return 1024 + zlib.crc32(str(dtype).encode()) % (2**31 - 1024)


def known_codes() -> tuple[dict[torch.dtype, int], list[int]]:
    """The table, {dtype: code}, for the dtypes this torch has, and each code's item size in
    bytes (0 for a code it does not have)."""
    itemsize = [0] * (max(_CODES.values()) + 1)
    for dtype, code in _CODES.items():
        itemsize[code] = dtype.itemsize
    return dict(_CODES), itemsize


def dtype_names() -> dict[int, str]:
    return {code: str(dtype) for dtype, code in _CODES.items()}
