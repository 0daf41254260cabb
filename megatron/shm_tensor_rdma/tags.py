"""Tags that encode (kind, chunk, microbatch) for pipeline messages.

Layout of the signed 64-bit tag: kind in bits 48..55, chunk in bits 32..47, microbatch in
bits 0..31. Any int64 works as a tag; this is only a convention for pipeline schedulers.
"""
from __future__ import annotations

_KIND_LIMIT = 1 << 8
_CHUNK_LIMIT = 1 << 16
_MICROBATCH_LIMIT = 1 << 32


def make_tag(kind: int, chunk: int, microbatch: int) -> int:
    """Packs the three fields; raises ValueError when one is out of range."""
    for name, value, limit in (("kind", kind, _KIND_LIMIT), ("chunk", chunk, _CHUNK_LIMIT),
                               ("microbatch", microbatch, _MICROBATCH_LIMIT)):
        if not 0 <= value < limit:
            raise ValueError(f"{name}={value} is outside [0, {limit})")
    return (kind << 48) | (chunk << 32) | microbatch


def split_tag(tag: int) -> tuple[int, int, int]:
    """Inverse of make_tag: (kind, chunk, microbatch)."""
    return (tag >> 48) & (_KIND_LIMIT - 1), (tag >> 32) & (_CHUNK_LIMIT - 1), tag & (_MICROBATCH_LIMIT - 1)
