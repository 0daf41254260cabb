"""The checkpoint files themselves: a rank's file written atomically while its bytes are hashed
(sha256), the manifest of sizes and checksums a save leaves beside them, the checks of a
checkpoint directory against it, and the layer split a file's layout records. checkpoint.py saves, finds and loads checkpoints with these."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
# sha256: with OpenSSL's SHA extensions hashlib hashes about as fast as zlib.crc32 (~1 GB/s on this
# project's CPUs, faster than blake2b), releases the GIL, and `sha256sum FILE` checks it by hand.
CHECKSUM = "sha256"

# The layout signature's layer split, and a decoder layer's parameter name (global layer number).
SPLIT = "pipeline_layer_split"
DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def saved_layer_split(layout: dict) -> list[int]:
    """The layer split a checkpoint's layout signature records (checkpoints written before splits
    were recorded hold the even one)."""
    if layout.get(SPLIT) is not None:
        return [int(n) for n in layout[SPLIT]]
    pp = int(layout["pipeline_model_parallel_size"])
    return [int(layout["num_layers"]) // pp] * pp


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, or does not match the launch configuration."""


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank; the partial checkpoint was removed and the tracker left alone."""


class _HashingWriter:
    """The file object torch.save writes through (sequentially, never seeking): counts and hashes
    the bytes, and keeps the OSError a write raised (torch.save reports it as an opaque
    RuntimeError)."""

    def __init__(self, file):
        self.file, self.digest, self.size, self.error = file, hashlib.new(CHECKSUM), 0, None

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.digest.update(data)
        self.size += written
        return written

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            self.error = exc
            raise


def write_rank_file(target: Path, payload: dict) -> dict[str, Any]:
    """One rank's file, whole or not at all: a temp file beside it, synced, then renamed. Returns
    its manifest entry (size and checksum); raises the OSError of a failed write."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            sink = _HashingWriter(f)
            try:
                torch.save(payload, sink)
            except RuntimeError as exc:
                if sink.error is not None:
                    raise sink.error from exc
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"size": sink.size, CHECKSUM: sink.digest.hexdigest()}


def file_checksum(path: Path) -> str:
    digest = hashlib.new(CHECKSUM)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory: Path) -> dict | None:
    """The manifest of an iteration directory; None for a checkpoint written before manifests."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or manifest.get("checksum", CHECKSUM) != CHECKSUM:
            raise ValueError("no files table, or another checksum")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} cannot be read ({exc}); the checkpoint is damaged") from exc
    return manifest


def file_problem(directory: Path, relative: str, entry: dict) -> str | None:
    """What is wrong with one file of a checkpoint, checked against its manifest entry; None if intact."""
    path = directory / relative
    if not path.is_file():
        return f"{path} is missing (its {MANIFEST} lists it)"
    size = path.stat().st_size
    if size != entry["size"]:
        how = "truncated" if size < entry["size"] else "longer than saved"
        return f"{path} is {how}: {size} bytes, its {MANIFEST} records {entry['size']}"
    if file_checksum(path) != entry[CHECKSUM]:
        return (f"{path} does not match its {CHECKSUM} checksum in {MANIFEST} (same size, different content: "
                "a changed or flipped byte)")
    return None


def checkpoint_problems(directory: Path) -> list[str] | None:
    """Every damaged file of a saved iteration (sizes first, then checksums); None if it has no manifest."""
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    problems = []
    for relative, entry in manifest["files"].items():
        path = directory / relative
        if not path.is_file() or path.stat().st_size != entry["size"]:
            problems.append(file_problem(directory, relative, entry))
    if problems:
        return problems
    return [p for p in (file_problem(directory, r, e) for r, e in manifest["files"].items()) if p]
