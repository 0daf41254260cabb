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
converted while loading (checkpoint_convert.py); the files, their checksums and the manifest are
checkpoint_files.py. The module is over 400 lines because saving (the ranks' agreement on a save
and its failure report) and loading (finding the newest intact iteration, checking the layout
signature) share the directory layout and layout signature defined here.
"""
from __future__ import annotations

import errno
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

from megatron.app.checkpoint_convert import convert_rank_payload
from megatron.app.checkpoint_files import (CHECKSUM, DECODER_LAYER, MANIFEST, SPLIT, CheckpointError,
                                           CheckpointSaveError, checkpoint_problems, file_problem, read_manifest,
                                           saved_layer_split, write_rank_file)
from megatron.app.config import format_layer_split
from megatron.app.model import global_parameter_name, unwrap_model
from megatron.app.optimizers import Fp16Optimizer, TorchOptimizer

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1
_ITERATION_DIR = re.compile(r"^iter_(\d+)$")
_STAGING_DIR = re.compile(r"^iter_\d+\.tmp$")


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


def parameter_key(chunk: torch.nn.Module, local_name: str) -> str:
    """The name a checkpoint converter tracks a state entry of a model chunk by: decoder layers by
    their global layer number, everything else (embedding, final norm, output layer: they stay on
    the first and last stage) by its name in the chunk."""
    if DECODER_LAYER.match(local_name):
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


def load_progress(root: str, cfg, tp_rank: int, pp_rank: int, any_tensor_parallel_size: bool = False) -> tuple[int, int]:
    """Resume a rank that gets its weights from elsewhere: only the iteration, the consumed samples
    and the RNG state of file (tp_rank, pp_rank) are restored (its layer split does not matter).
    With `any_tensor_parallel_size`, the file may come from a run of another TP size (a merged rank
    reads TP rank 0's file)."""
    ignore = ("tensor_model_parallel_size", SPLIT) if any_tensor_parallel_size else (SPLIT,)
    payload = _read_rank_file(root, cfg, tp_rank, pp_rank, ignore)
    set_rng_state(payload["rng"])
    return payload["iteration"], payload["consumed_samples"]
