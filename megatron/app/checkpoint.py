"""Checkpoints: one file per (tp, pp) rank under `iter_NNNNNNN/`, written atomically.

Each rank writes its file into `iter_N.tmp/` (temp file + rename); after all ranks finished,
global rank 0 renames the directory to `iter_N/` and then updates the tracker file. A run killed
mid-save leaves only a `.tmp` directory, which is never loaded.
"""
from __future__ import annotations

import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron.app.model import unwrap_model

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, or does not match the launch configuration."""


def iteration_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def rank_file(directory: Path, tp_rank: int, pp_rank: int) -> Path:
    return directory / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" / "model_optim_rng.pt"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    }


def save_checkpoint(root: str, iteration: int, consumed_samples: int, chunks, optimizer, cfg,
                    tp_rank: int, pp_rank: int, dp_rank: int) -> Path:
    """Collective over all ranks. Returns the final directory."""
    final = iteration_dir(root, iteration)
    staging = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if staging.exists():
            shutil.rmtree(staging)  # a torn earlier attempt at this same iteration, made by us
        staging.mkdir(parents=True)
    dist.barrier()
    if dp_rank == 0:
        target = rank_file(staging, tp_rank, pp_rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "layout": layout_signature(cfg),
            "model": [unwrap_model(c).state_dict() for c in chunks],
            "optimizer": optimizer.state_dict(),
            "rng": rng_state(),
            "args": {k: v for k, v in vars(cfg.args).items() if isinstance(v, (int, float, str, bool, type(None), list))},
            "model_config": asdict(cfg.model),
        }
        tmp = target.with_name(target.name + ".tmp")
        torch.save(payload, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _atomic_write_text(Path(root) / TRACKER, f"{iteration}\n")
    dist.barrier()
    return final


def has_checkpoint(root: str) -> bool:
    """Whether `root` holds a complete checkpoint (its tracker file exists)."""
    return (Path(root) / TRACKER).is_file()


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


def _read_rank_file(root: str, cfg, tp_rank: int, pp_rank: int, ignore: tuple[str, ...] = ()) -> dict:
    """The latest checkpoint's file of (tp_rank, pp_rank), checked against the run's layout
    (except the `ignore`d entries)."""
    iteration = find_latest(root)
    path = rank_file(iteration_dir(root, iteration), tp_rank, pp_rank)
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the checkpoint in {root} was not saved with this rank's "
            f"(tp={tp_rank}, pp={pp_rank}) coordinates; load it with the parallel sizes it was saved with"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read ({exc}); the file is damaged") from exc
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
    """Returns (iteration, consumed_samples). Raises CheckpointError with what to change."""
    payload = _read_rank_file(root, cfg, tp_rank, pp_rank)
    for chunk, state in zip(chunks, payload["model"]):
        unwrap_model(chunk).load_state_dict(state)
    optimizer.load_state_dict(payload["optimizer"])
    set_rng_state(payload["rng"])
    return payload["iteration"], payload["consumed_samples"]


def load_progress(root: str, cfg, tp_rank: int, pp_rank: int, any_tensor_parallel_size: bool = False) -> tuple[int, int]:
    """Resume a rank that gets its weights from elsewhere: only the iteration, the consumed samples
    and the RNG state of file (tp_rank, pp_rank) are restored. With `any_tensor_parallel_size`, the
    file may come from a run of another TP size (a merged rank reads TP rank 0's file)."""
    ignore = ("tensor_model_parallel_size",) if any_tensor_parallel_size else ()
    payload = _read_rank_file(root, cfg, tp_rank, pp_rank, ignore)
    set_rng_state(payload["rng"])
    return payload["iteration"], payload["consumed_samples"]
