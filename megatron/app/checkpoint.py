"""Checkpoints: one file per (tp, pp) rank under `iter_NNNNNNN/`, written atomically.

Each rank writes its file into `iter_N.tmp/` (temp file + rename), hashing the bytes as they are
written (sha256); the ranks then agree, through one all-gather, that every file is in. Global rank 0
writes `manifest.json` (size and sha256 of every file) into the staging directory, renames it to
`iter_N/` and then updates the tracker file. A run killed mid-save leaves only a `.tmp` directory,
which is never loaded and is removed by the next save. A rank that fails to write (disk full, any
OSError) reaches the others through the same all-gather: the staging directory is removed, the
tracker is left alone and every rank stops with one message. Loading checks each file a rank reads
against the manifest (checkpoints without one, written before it existed, load unverified); a
damaged checkpoint is reported with the newest intact iteration to load with `--ckpt-step N`.

A checkpoint saved with another pipeline layer split (same TP and PP sizes, same model) is
converted while loading: `convert_rank_payload` builds the file the run would have written with its
own split from the saved files of its TP rank, moving decoder layers and their optimizer state by
global layer number. tools/convert_checkpoint.py writes such files for a whole checkpoint. The
module is over 400 lines because the converter and the integrity checks (manifest, the ranks'
agreement on a save, finding the newest intact iteration) work on the file format, layout signature
and errors defined here, and saving and loading call them.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron.app.config import chunk_layers, first_layer_of, format_layer_split, locate_layer
from megatron.app.model import global_parameter_name, unwrap_model
from megatron.app.optimizers import Fp16Optimizer, TorchOptimizer, applies_weight_decay, group_order

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# sha256: with OpenSSL's SHA extensions hashlib hashes about as fast as zlib.crc32 (~1 GB/s on this
# project's CPUs, faster than blake2b), releases the GIL, and `sha256sum FILE` checks it by hand.
CHECKSUM = "sha256"
_ITERATION_DIR = re.compile(r"^iter_(\d+)$")
_STAGING_DIR = re.compile(r"^iter_\d+\.tmp$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, or does not match the launch configuration."""


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank; the partial checkpoint was removed and the tracker left alone."""


def iteration_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def rank_file(directory: Path, tp_rank: int, pp_rank: int) -> Path:
    return directory / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" / "model_optim_rng.pt"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def layout_signature(cfg) -> dict[str, Any]:
    """What must match between the saving and the loading run."""
    m, p = cfg.model, cfg.parallel
    return {
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "num_chunks": cfg.num_chunks,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "ffn_hidden_size": m.ffn_hidden_size,
        "padded_vocab_size": m.padded_vocab_size,
        "untie_embeddings_and_output_weights": m.untie_embeddings_and_output_weights,
        "position_embedding_type": m.position_embedding_type,
        SPLIT: p.layers_per_stage(m.num_layers),
    }


SPLIT = "pipeline_layer_split"
_DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# The parameters megatron-core marks `is_embedding_or_output_parameter` (their own groups with
# --decoupled-lr); only needed for checkpoints that do not record their optimizer's parameter order.
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
_Entry = tuple[torch.Tensor, dict, bool]  # a saved parameter: tensor, optimizer state, decoupled group or not


def saved_layer_split(layout: dict) -> list[int]:
    """The layer split a checkpoint's layout signature records (checkpoints written before splits
    were recorded hold the even one)."""
    if layout.get(SPLIT) is not None:
        return [int(n) for n in layout[SPLIT]]
    pp = int(layout["pipeline_model_parallel_size"])
    return [int(layout["num_layers"]) // pp] * pp


def parameter_key(chunk: torch.nn.Module, local_name: str) -> str:
    """The name a checkpoint converter tracks a state entry of a model chunk by: decoder layers by
    their global layer number, everything else (embedding, final norm, output layer: they stay on
    the first and last stage) by its name in the chunk."""
    if _DECODER_LAYER.match(local_name):
        return global_parameter_name(chunk, local_name)
    return local_name


def optimizer_kind(optimizer) -> str:
    if isinstance(optimizer, Fp16Optimizer):
        return "fp16-adamw"
    if isinstance(optimizer, TorchOptimizer):
        return "adamw"
    return "megatron-core"


def optimizer_parameter_keys(chunks, optimizer) -> list[str] | None:
    """`parameter_key` of each parameter in the optimizer's order (the positions its state_dict
    is keyed by); None for megatron-core's optimizer."""
    key_of = {}
    for chunk in chunks:
        module = unwrap_model(chunk)
        for local_name, param in module.named_parameters():
            key_of[id(param)] = parameter_key(module, local_name)
    if isinstance(optimizer, Fp16Optimizer):
        params = [param for param, _ in optimizer.pairs]
    elif isinstance(optimizer, TorchOptimizer):
        params = [param for group in optimizer.param_groups for param in group["params"]]
    else:
        return None
    return [key_of[id(param)] for param in params]


def save_checkpoint(root: str, iteration: int, consumed_samples: int, chunks, optimizer, cfg,
                    tp_rank: int, pp_rank: int, dp_rank: int) -> Path:
    """Collective over all ranks. Returns the final directory; raises CheckpointSaveError on every
    rank when any rank failed (the staging directory removed, the tracker untouched)."""
    final = iteration_dir(root, iteration)
    staging = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    report: dict[str, Any] = {"rank": rank, "files": {}, "error": None}
    if rank == 0:
        try:
            for stale in remove_stale_staging(root):
                print(f"removed {stale}, left by an earlier save that did not finish", flush=True)
            staging.mkdir(parents=True)
            report["previous"] = _previous_checkpoint(root)
        except OSError as exc:
            report["error"] = _failure(rank, exc, staging)
    reports = _all_gather(report)  # every rank waits here until the staging directory exists
    if not any(r["error"] for r in reports):
        if dp_rank == 0:
            target = rank_file(staging, tp_rank, pp_rank)
            try:
                payload = {
                    "format_version": FORMAT_VERSION,
                    "iteration": iteration,
                    "consumed_samples": consumed_samples,
                    "layout": layout_signature(cfg),
                    "model": [unwrap_model(c).state_dict() for c in chunks],
                    "optimizer": optimizer.state_dict(),
                    "optimizer_kind": optimizer_kind(optimizer),
                    "optimizer_keys": optimizer_parameter_keys(chunks, optimizer),
                    "rng": rng_state(),
                    "args": {k: v for k, v in vars(cfg.args).items()
                             if isinstance(v, (int, float, str, bool, type(None), list))},
                    "model_config": asdict(cfg.model),
                }
                report["estimate"] = payload_bytes(payload)
                report["free"] = _free_bytes(staging)
                report["files"][target.relative_to(staging).as_posix()] = write_rank_file(target, payload)
            except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks
                report["error"] = _failure(rank, exc, target)
        reports = _all_gather(report)  # the ranks agree whether every file is in
    if not any(r["error"] for r in reports):
        if rank == 0:
            files = {name: entry for r in reports for name, entry in r["files"].items()}
            created = False
            try:
                manifest = {"format_version": FORMAT_VERSION, "iteration": iteration, "checksum": CHECKSUM,
                            "files": dict(sorted(files.items()))}
                atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=1) + "\n")
                if final.exists():
                    shutil.rmtree(final)
                os.replace(staging, final)
                created = True
                atomic_write_text(Path(root) / TRACKER, f"{iteration}\n")
            except OSError as exc:
                report["error"] = _failure(rank, exc, Path(root) / TRACKER if created else staging / MANIFEST)
                if created:  # renamed, but the tracker does not name it: not a checkpoint
                    shutil.rmtree(final, ignore_errors=True)
        reports = _all_gather({**report, "files": {}})  # the ranks agree whether rank 0 committed
    failed = [r for r in reports if r["error"]]
    if failed:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()  # the staging directory is gone before any rank exits
        raise CheckpointSaveError(_save_failure_message(root, iteration, staging, reports, failed))
    return final


def _all_gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def remove_stale_staging(root: str) -> list[Path]:
    """Remove the `iter_*.tmp` directories in `root` (saves that did not finish); returns them."""
    removed = []
    if Path(root).is_dir():
        for entry in sorted(Path(root).iterdir()):
            if _STAGING_DIR.match(entry.name) and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
                removed.append(entry)
    return removed


def _previous_checkpoint(root: str) -> tuple[int, int] | None:
    """(iteration, bytes) of the checkpoint the tracker names, or None."""
    try:
        iteration = find_latest(root)
    except CheckpointError:
        return None
    directory = iteration_dir(root, iteration)
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) if directory.is_dir() else 0
    return iteration, size


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def payload_bytes(obj: Any, seen: set | None = None) -> int:
    """The tensor bytes a payload holds (each storage once): about the size of its file."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(payload_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v, seen) for v in obj)
    return 0


def _failure(rank: int, exc: BaseException, path: Path) -> dict[str, Any]:
    return {"rank": rank, "path": str(path), "what": f"{type(exc).__name__}: {exc}",
            "oserror": isinstance(exc, OSError),
            "disk_full": isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)}


def format_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _save_failure_message(root: str, iteration: int, staging: Path, reports: list[dict], failed: list[dict]) -> str:
    first = failed[0]["error"]
    errors = [r["error"] for r in failed]
    previous = reports[0].get("previous")
    what = "the disk is full" if any(e["disk_full"] for e in errors) else "writing failed"
    lines = [f"saving the checkpoint of iteration {iteration} to {root} failed: {what} "
             f"(rank {first['rank']} writing {first['path']}: {first['what']})"]
    if len(errors) > 1:
        lines[0] += f"; ranks {', '.join(str(e['rank']) for e in errors)} failed"
    if any(e["oserror"] for e in errors):
        estimate = sum(r.get("estimate", 0) for r in reports)
        need = f"the checkpoint needs about {format_bytes(estimate)}" if estimate else "the checkpoint's size is unknown"
        if previous:
            need += f" (the previous one, {iteration_dir(root, previous[0]).name}, holds {format_bytes(previous[1])})"
        frees = [r["free"] for r in reports if r.get("free") is not None]
        free = max(frees) if frees else _free_bytes(Path(root))
        lines.append(f"{need}; {format_bytes(free) if free is not None else 'an unknown amount'} "
                     f"were free on the filesystem of {root} when the save started")
    if previous:
        resume = (f"{TRACKER} still names iteration {previous[0]}: free space (or --save to a larger "
                  f"filesystem) and rerun the same command to resume from iteration {previous[0]}")
    else:
        resume = f"no checkpoint was saved in {root} before this one"
    lines.append(f"the partial {staging.name}/ was removed; {resume}")
    return "\n".join(lines)


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


def saved_iterations(root: str) -> list[int]:
    """The iterations with a (renamed, so once complete) iteration directory in `root`, ascending."""
    if not Path(root).is_dir():
        return []
    found = (_ITERATION_DIR.match(entry.name) for entry in Path(root).iterdir() if entry.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def newest_intact(root: str, exclude: int) -> str:
    """A sentence naming the newest iteration in `root` (other than `exclude`) whose files all match
    its manifest, and how to load it."""
    skipped = []
    for iteration in reversed(saved_iterations(root)):
        if iteration == exclude:
            continue
        name = iteration_dir(root, iteration).name
        try:
            problems = checkpoint_problems(iteration_dir(root, iteration))
        except CheckpointError as exc:
            problems = [str(exc)]
        if problems is None:
            return (f"the newest other checkpoint in {root} is iteration {iteration} ({name} has no {MANIFEST}: saved "
                    f"before checksums were recorded, so it cannot be verified); load it with --ckpt-step {iteration}")
        if not problems:
            tail = f" ({', '.join(skipped)} damaged too)" if skipped else ""
            return (f"the newest intact checkpoint in {root} is iteration {iteration}{tail}: load it with "
                    f"--ckpt-step {iteration} (the other flags unchanged)")
        skipped.append(name)
    return f"no other intact checkpoint in {root}{' (' + ', '.join(skipped) + ' damaged too)' if skipped else ''}"


def read_rank_file(path: Path) -> dict:
    """A rank file's payload, checked against its iteration's manifest when there is one;
    CheckpointError (naming what is wrong and the newest intact iteration) when it cannot be read."""
    path = Path(path)
    directory = path.parents[1]
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}\n{_intact_hint(directory)}") from exc
    if manifest is not None:
        relative = path.relative_to(directory).as_posix()
        entry = manifest["files"].get(relative)
        problem = (f"{path} is not one of the files its {MANIFEST} lists" if entry is None
                   else file_problem(directory, relative, entry))
        if problem:
            raise CheckpointError(f"checkpoint {directory} is damaged: {problem}\n{_intact_hint(directory)}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        hint = f"\n{_intact_hint(directory)}" if _ITERATION_DIR.match(directory.name) else ""
        raise CheckpointError(f"{path} cannot be read ({exc}); the file is damaged{hint}") from exc


def _intact_hint(directory: Path) -> str:
    match = _ITERATION_DIR.match(directory.name)
    if not match:
        return ""
    return newest_intact(str(directory.parent), int(match.group(1)))


def has_checkpoint(root: str) -> bool:
    """Whether `root` holds a complete checkpoint (its tracker file exists)."""
    return (Path(root) / TRACKER).is_file()


def load_iteration(root: str, cfg) -> int:
    """The iteration a run loads from `root`: --ckpt-step N (cfg.checkpoint.ckpt_step), else the
    tracker's latest."""
    step = getattr(getattr(cfg, "checkpoint", None), "ckpt_step", None)
    if step is None:
        return find_latest(root)
    if not Path(root).is_dir():
        raise CheckpointError(f"--load {root}: directory does not exist; check the path or drop --load")
    if not iteration_dir(root, step).is_dir():
        saved = saved_iterations(root)
        held = (f"it holds iteration{'s' if len(saved) > 1 else ''} {', '.join(map(str, saved))}" if saved
                else "it holds no complete checkpoint")
        try:
            held += f" (the latest, per {TRACKER}: {find_latest(root)})"
        except CheckpointError:
            pass
        raise CheckpointError(f"--ckpt-step {step}: --load {root} holds no iteration {step} "
                              f"(no {iteration_dir(root, step).name}); {held}")
    return step


def find_latest(root: str) -> int:
    tracker = Path(root) / TRACKER
    if not Path(root).is_dir():
        raise CheckpointError(f"--load {root}: directory does not exist; check the path or drop --load")
    if not tracker.is_file():
        raise CheckpointError(
            f"--load {root}: no {TRACKER} in it, so it holds no complete checkpoint "
            "(a save that was interrupted leaves only iter_*.tmp directories)"
        )
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number")
    return int(text)


_UNVERIFIED_NOTED: set[Path] = set()


def check_room_for_next_save(root: str, rank: int) -> None:
    """Collective, at start-up: stop every rank now if --save's filesystem cannot hold another
    checkpoint as large as its latest (checkpoints are kept, so the next needs that much free). A
    job whose save failed on a full disk would otherwise, restarted by torchrun, train up to the
    same save and fail again, once per restart."""
    problem = None
    previous = _previous_checkpoint(root) if rank == 0 else None
    if previous and previous[1]:
        free = _free_bytes(Path(root))
        if free is not None and free < previous[1]:
            iteration, size = previous
            problem = (f"not enough space to save the next checkpoint to {root}: the latest one "
                       f"({iteration_dir(root, iteration).name}) holds {format_bytes(size)} and "
                       f"{format_bytes(free)} are free on its filesystem\nfree space (or --save to a larger "
                       f"filesystem) and rerun the same command to resume from iteration {iteration} (checked "
                       f"before training, so a restarted job does not train up to a save that cannot be written)")
    problems = _all_gather(problem) if dist.is_initialized() else [problem]
    found = next((text for text in problems if text is not None), None)
    if found is not None:
        raise CheckpointSaveError(found)


def agree_on_load(failure: BaseException | None) -> None:
    """Collective: after each rank loaded (or failed to), every rank learns whether all succeeded,
    so a damaged file found by one rank stops all of them before training, with its message."""
    message = None if failure is None else str(failure) or type(failure).__name__
    messages = _all_gather(message) if dist.is_initialized() else [message]
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if not failed:
        return
    if failure is not None and not isinstance(failure, CheckpointError):
        raise failure
    rank, text = failed[0]
    if len(failed) < len(messages) or any(other != text for _, other in failed):
        others = [str(r) for r, _ in failed[1:]]
        also = f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(others)})" if others else ""
        text = f"loading the checkpoint failed on rank {rank}{also}: {text}"
    raise CheckpointError(text)


def _read_rank_file(root: str, cfg, tp_rank: int, pp_rank: int, ignore: tuple[str, ...] = ()) -> dict:
    """The latest checkpoint's file of (tp_rank, pp_rank), checked against the run's layout
    (except the `ignore`d entries)."""
    iteration = load_iteration(root, cfg)
    directory = iteration_dir(root, iteration)
    path = rank_file(directory, tp_rank, pp_rank)
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}\n{newest_intact(root, iteration)}") from exc
    if manifest is None and directory.is_dir() and directory not in _UNVERIFIED_NOTED:
        _UNVERIFIED_NOTED.add(directory)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"note: {directory} has no {MANIFEST} (saved before checksums were recorded); "
                  "loading it without verifying its files", flush=True)
    listed = manifest is not None and path.relative_to(directory).as_posix() in manifest["files"]
    if not path.is_file() and not listed:
        raise CheckpointError(
            f"{path} is missing: the checkpoint in {root} was not saved with this rank's "
            f"(tp={tp_rank}, pp={pp_rank}) coordinates; load it with the parallel sizes it was saved with"
        )
    payload = read_rank_file(path)
    expected = layout_signature(cfg)
    saved = payload.get("layout", {})
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs run {v!r}" for k, v in expected.items()
             if k not in ignore and saved.get(k) != v]
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} does not match this run:\n  " + "\n  ".join(diffs)
            + "\nlaunch with the checkpoint's model and parallel sizes"
        )
    return payload


def load_checkpoint(root: str, chunks, optimizer, cfg, tp_rank: int, pp_rank: int) -> tuple[int, int]:
    """Returns (iteration, consumed_samples). Raises CheckpointError with what to change. A
    checkpoint saved with another pipeline layer split is converted to the run's."""
    payload = _read_rank_file(root, cfg, tp_rank, pp_rank, ignore=(SPLIT,))
    saved_split, split = saved_layer_split(payload["layout"]), layout_signature(cfg)[SPLIT]
    if saved_split != split:
        payload = _convert_while_loading(root, payload, chunks, optimizer, cfg, tp_rank, pp_rank)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"converted checkpoint from layer split {format_layer_split(saved_split)} to "
                  f"{format_layer_split(split)} while loading", flush=True)
    for chunk, state in zip(chunks, payload["model"]):
        unwrap_model(chunk).load_state_dict(state)
    optimizer.load_state_dict(payload["optimizer"])
    set_rng_state(payload["rng"])
    return payload["iteration"], payload["consumed_samples"]


def _convert_while_loading(root: str, own: dict, chunks, optimizer, cfg, tp_rank: int, pp_rank: int) -> dict:
    saved = format_layer_split(saved_layer_split(own["layout"]))
    if optimizer_kind(optimizer) == "megatron-core":
        raise CheckpointError(
            f"the checkpoint in {root} was saved with layer split {saved}, this run asks for "
            f"{format_layer_split(layout_signature(cfg)[SPLIT])}: converting while loading is done for this "
            "trainer's CPU optimizer only, not megatron-core's (--device cuda). Resume with --pipeline-layer-split "
            f"{saved}; tools/convert_checkpoint.py converts checkpoints of CPU runs only")
    files = {pp_rank: own}

    def read(stage: int) -> dict:
        if stage not in files:
            files[stage] = _read_rank_file(root, cfg, tp_rank, stage, ignore=(SPLIT,))
        return files[stage]

    try:
        converted = convert_rank_payload(read, pp_rank, layout_signature(cfg)[SPLIT])
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}\nresume with --pipeline-layer-split {saved} (the saved split)") from exc
    if converted["optimizer_kind"] != optimizer_kind(optimizer):
        raise CheckpointError(
            f"the checkpoint in {root} holds {converted['optimizer_kind']} optimizer state but this run uses "
            f"{optimizer_kind(optimizer)}; resume with the precision flags (--fp16) it was saved with")
    expected = optimizer_parameter_keys(chunks, optimizer)
    if converted["optimizer_keys"] != expected:
        raise CheckpointError(
            f"converting the checkpoint in {root} from layer split {saved}: the converted optimizer state does not "
            f"line up with this run's parameters (stage {pp_rank}: {len(converted['optimizer_keys'])} converted, "
            f"{len(expected)} in the optimizer); resume with --pipeline-layer-split {saved}")
    return converted


def convert_rank_payload(read, stage: int, split: list[int]) -> dict:
    """The checkpoint file stage `stage` of one TP rank would hold with layer split `split`, built
    from the saved files of that TP rank (`read(stage) -> payload`, read only where needed): the
    stage's own file gives the embedding, final norm, output layer (tied or not), RNG state, loss
    scaler and iteration; each decoder layer, with its optimizer state (AdamW moments and step, fp16
    master weights), comes from the file that holds it under the saved split. Same TP and PP sizes,
    number of layers and virtual chunks as the saved run."""
    own = read(stage)
    layout = own["layout"]
    problems = conversion_problems(own, split)
    if problems:
        raise CheckpointError("cannot convert the checkpoint: " + "; ".join(problems))
    saved_split = saved_layer_split(layout)
    num_chunks = int(layout.get("num_chunks", 1))
    kind = _optimizer_kind_of(own)
    old_sizes, new_sizes = chunk_layers(saved_split, num_chunks), chunk_layers(split, num_chunks)

    def source_of(key: str) -> tuple[int, str]:
        """(saved stage, key there is tracked by) of a converted state entry."""
        match = _DECODER_LAYER.match(key)
        return (locate_layer(old_sizes, int(match.group(1)))[0], key) if match else (stage, key)

    entries: dict[int, dict[str, _Entry]] = {}  # saved stage -> tracked key -> entry

    def entries_of(saved_stage: int) -> dict[str, _Entry]:
        if saved_stage not in entries:
            payload = read(saved_stage)
            if saved_layer_split(payload["layout"]) != saved_split or payload["iteration"] != own["iteration"]:
                raise CheckpointError(f"the saved files of stages {stage} and {saved_stage} come from different "
                                      "saves (layer split or iteration differ); the checkpoint is damaged")
            entries[saved_stage] = _tracked_entries(payload, saved_stage, old_sizes, kind)
        return entries[saved_stage]

    model, keys = [], []
    for chunk in range(num_chunks):
        state: dict[str, Any] = {}
        first = first_layer_of(new_sizes, stage, chunk)
        placed = False
        for local, value in own["model"][chunk].items():
            if not _DECODER_LAYER.match(local):
                state[local] = value
                keys.append(local)
                continue
            if placed:
                continue
            placed = True  # this chunk's decoder layers go where the saved chunk's were
            for index in range(new_sizes[stage][chunk]):
                layer = first + index
                saved_stage, saved_chunk, saved_index = locate_layer(old_sizes, layer)
                prefix = f"decoder.layers.{saved_index}."
                for saved_local, saved_value in read(saved_stage)["model"][saved_chunk].items():
                    if saved_local.startswith(prefix):
                        suffix = saved_local[len(prefix):]
                        state[f"decoder.layers.{index}.{suffix}"] = saved_value
                        keys.append(f"decoder.layers.{layer}.{suffix}")
        model.append(state)

    # The optimizer's parameter order as parameter_groups builds it: groups by (decay, decoupled)
    # in group_order, each in the chunks' parameter order.
    groups: dict[tuple[bool, bool], list[str]] = {}
    for key in keys:
        saved_stage, tracked = source_of(key)
        found = entries_of(saved_stage).get(tracked)
        if found is None:
            continue  # not a parameter (a buffer or extra state)
        tensor, _, decoupled = found
        groups.setdefault((applies_weight_decay(key, tensor.ndim), bool(decoupled)), []).append(key)
    own_groups = _group_settings(own, kind, entries_of(stage))
    order = sorted(groups, key=group_order)
    missing = [ident for ident in order if ident not in own_groups]
    if missing:
        raise CheckpointError(f"stage {stage}'s saved optimizer has no parameter group for {missing} "
                              "(decay, decoupled); the checkpoint cannot be converted")
    optimizer_keys = [key for ident in order for key in groups[ident]]
    found = [entries_of(saved_stage)[tracked] for saved_stage, tracked in map(source_of, optimizer_keys)]
    torch_state = {index: entry[1]["state"] for index, entry in enumerate(found) if entry[1]["state"] is not None}
    masters = [entry[1]["master"] for entry in found]
    param_groups, start = [], 0
    for ident in order:
        param_groups.append({**own_groups[ident], "params": list(range(start, start + len(groups[ident])))})
        start += len(groups[ident])
    optimizer = {"state": torch_state, "param_groups": param_groups}
    if kind == "fp16-adamw":
        optimizer = {"optimizer": optimizer, "masters": masters, "scaler": own["optimizer"]["scaler"]}
    converted = dict(own)
    converted.update(model=model, optimizer=optimizer, optimizer_kind=kind, optimizer_keys=optimizer_keys,
                     layout={**layout, SPLIT: list(split)})
    args = dict(own.get("args", {}))
    if args:
        args.update(pipeline_layer_split=list(split), decoder_first_pipeline_num_layers=None,
                    decoder_last_pipeline_num_layers=None)
        converted["args"] = args
    return converted


def conversion_problems(payload: dict, split: list[int]) -> list[str]:
    """What keeps a checkpoint (one of its rank files' `payload`) from being converted to `split`."""
    layout = payload["layout"]
    pp, num_layers = int(layout["pipeline_model_parallel_size"]), int(layout["num_layers"])
    num_chunks = int(layout.get("num_chunks", 1))
    shown = format_layer_split(split)
    problems = []
    if len(split) != pp:
        problems.append(f"layer split {shown} has {len(split)} entries but the checkpoint has {pp} pipeline stages; "
                        "give one layer count per stage")
    if sum(split) != num_layers:
        problems.append(f"layer split {shown} sums to {sum(split)}, but the sum must be the checkpoint's "
                        f"{num_layers} layers")
    if any(n < 1 or n % num_chunks for n in split):
        problems.append(f"layer split {shown}: the checkpoint has {num_chunks} model chunk(s) per stage, so every "
                        f"entry must be a positive multiple of {num_chunks}")
    if _optimizer_kind_of(payload) == "megatron-core":
        problems.append(f"it holds megatron-core's optimizer state (a --device cuda run, saved with layer split "
                        f"{format_layer_split(saved_layer_split(layout))}); only checkpoints of this trainer's CPU "
                        "optimizer are converted")
    return problems


def _optimizer_kind_of(payload: dict) -> str:
    kind = payload.get("optimizer_kind")
    if kind is not None:
        return kind
    state = payload.get("optimizer", {})
    if isinstance(state, dict) and "masters" in state and "scaler" in state:
        return "fp16-adamw"
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if groups and "state" in state and all("decoupled" in group for group in groups):
        return "adamw"
    return "megatron-core"


def _torch_state(payload: dict, kind: str) -> dict:
    return payload["optimizer"]["optimizer"] if kind == "fp16-adamw" else payload["optimizer"]


def _tracked_entries(payload: dict, stage: int, sizes: list[list[int]], kind: str) -> dict[str, _Entry]:
    """Tracked key -> (tensor, {"state": AdamW state, "master": fp16 master}, decoupled) of every
    parameter in a saved stage file."""
    tensors = {}
    for chunk, state in enumerate(payload["model"]):
        first = first_layer_of(sizes, stage, chunk)
        for local, value in state.items():
            match = _DECODER_LAYER.match(local)
            key = f"decoder.layers.{first + int(match.group(1))}.{local[match.end():]}" if match else local
            tensors[key] = value
    keys = payload.get("optimizer_keys") or _reconstructed_keys(payload, tensors, kind)
    torch_state = _torch_state(payload, kind)
    decoupled_at = {}
    for group in torch_state["param_groups"]:
        for index in group["params"]:
            decoupled_at[index] = bool(group.get("decoupled"))
    masters = payload["optimizer"]["masters"] if kind == "fp16-adamw" else None
    if len(keys) != len(decoupled_at) or (masters is not None and len(masters) != len(keys)):
        raise CheckpointError(f"stage {stage}'s saved optimizer holds {len(decoupled_at)} parameters but its model "
                              f"{len(keys)}; the checkpoint cannot be converted")
    return {key: (tensors[key], {"state": torch_state["state"].get(index),
                                 "master": masters[index] if masters is not None else None}, decoupled_at[index])
            for index, key in enumerate(keys)}


def _reconstructed_keys(payload: dict, tensors: dict[str, Any], kind: str) -> list[str]:
    """The optimizer's parameter order of a file that does not record it: the model's tensors in
    state_dict order, grouped as parameter_groups groups them; checked against the saved groups."""
    groups = _torch_state(payload, kind)["param_groups"]
    decoupled_on = any(group.get("decoupled") for group in groups)
    by_group: dict[tuple[bool, bool], list[str]] = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
            continue
        ident = (applies_weight_decay(key, value.ndim), decoupled_on and key in _EMBEDDING_OR_OUTPUT)
        by_group.setdefault(ident, []).append(key)
    order = sorted(by_group, key=group_order)
    if [len(by_group[ident]) for ident in order] != [len(group["params"]) for group in groups] or any(
            bool(group.get("decoupled")) != ident[1] for ident, group in zip(order, groups)):
        raise CheckpointError("the checkpoint does not record its optimizer's parameter order and it cannot be "
                              "told from the model's; it cannot be converted to another layer split")
    return [key for ident in order for key in by_group[ident]]


def _group_settings(payload: dict, kind: str, entries: dict) -> dict[tuple[bool, bool], dict]:
    """(decay, decoupled) -> the saved group's settings (lr, betas, weight decay, ...), of one file."""
    keys = list(entries)  # in the optimizer's order
    settings = {}
    for group in _torch_state(payload, kind)["param_groups"]:
        if not group["params"]:
            continue
        tensor, _, decoupled = entries[keys[group["params"][0]]]
        ident = (applies_weight_decay(keys[group["params"][0]], tensor.ndim), bool(decoupled))
        settings[ident] = {k: v for k, v in group.items() if k != "params"}
    return settings


def load_progress(root: str, cfg, tp_rank: int, pp_rank: int, any_tensor_parallel_size: bool = False) -> tuple[int, int]:
    """Resume a rank that gets its weights from elsewhere: only the iteration, the consumed samples
    and the RNG state of file (tp_rank, pp_rank) are restored (its layer split does not matter).
    With `any_tensor_parallel_size`, the file may come from a run of another TP size (a merged rank
    reads TP rank 0's file)."""
    ignore = ("tensor_model_parallel_size", SPLIT) if any_tensor_parallel_size else (SPLIT,)
    payload = _read_rank_file(root, cfg, tp_rank, pp_rank, ignore)
    set_rng_state(payload["rng"])
    return payload["iteration"], payload["consumed_samples"]
