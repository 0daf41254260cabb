"""Convert a checkpoint to another pipeline layer split:

    python tools/convert_checkpoint.py --load DIR --save OUT --pipeline-layer-split 3,5

The checkpoint's latest iteration (or --iteration N) is rewritten for the same TP and PP sizes with
the given layers per stage: decoder layers and their optimizer state move between stage files by
global layer number; the embedding, final norm and output layer, the RNG states and the loss scaler
stay with their stage. Resume from OUT with the same --pipeline-layer-split. The output is written
as the trainer writes checkpoints (`OUT/iter_N.tmp/`, renamed to `iter_N/` once every file is
complete, then the tracker file), so an interrupted conversion leaves no checkpoint behind.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as `python tools/convert_checkpoint.py` from a checkout: make `megatron.app` importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron.app import checkpoint as ckpt  # noqa: E402
from megatron.app.checkpoint_convert import conversion_problems, convert_rank_payload  # noqa: E402
from megatron.app.config import format_layer_split, parse_layer_split  # noqa: E402
from megatron.app.progress import Reporter, reporter  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/convert_checkpoint.py",
        description="Rewrite a pretrain_gpt.py checkpoint for another --pipeline-layer-split (same TP and PP sizes).",
        allow_abbrev=False,
    )
    parser.add_argument("--load", required=True, metavar="DIR",
                        help="checkpoint directory to read (the --save directory of the run that wrote it)")
    parser.add_argument("--save", required=True, metavar="DIR",
                        help="directory to write the converted checkpoint to; must not be --load, and must not "
                             "hold the same iteration already")
    parser.add_argument("--pipeline-layer-split", required=True, type=parse_layer_split, metavar="N,N,...",
                        help="transformer layers on each pipeline stage of the converted checkpoint, comma "
                             "separated, stage 0 first: one entry per stage, summing to the model's layers")
    parser.add_argument("--iteration", type=int, default=None,
                        help="convert this saved iteration (default: the latest, from the tracker file)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def convert(load: str, save: str, split: list[int], iteration: int | None = None,
            progress: Reporter | None = None) -> tuple[Path, list[int]]:
    """Write the converted checkpoint; returns its iteration directory and the split it was saved
    with. Raises CheckpointError, before writing anything when the input or the split is wrong."""
    progress = progress or Reporter("convert_checkpoint", enabled=False)
    if iteration is None:
        iteration = ckpt.find_latest(load)
    source = ckpt.iteration_dir(load, iteration)
    if not source.is_dir():
        raise ckpt.CheckpointError(f"--load {load} holds no iteration {iteration} ({source} does not exist)")
    if Path(save).resolve() == Path(load).resolve():
        raise ckpt.CheckpointError("--save is the --load directory; write the converted checkpoint to another one")
    first = ckpt.rank_file(source, 0, 0)
    if not first.is_file():
        raise ckpt.CheckpointError(f"{first} is missing: {source} is not a complete checkpoint")
    header = ckpt.read_rank_file(first)
    layout = header.get("layout")
    if not layout:
        raise ckpt.CheckpointError(f"{first} records no layout; it was not written by pretrain_gpt.py")
    problems = conversion_problems(header, split)
    if problems:
        raise ckpt.CheckpointError("--pipeline-layer-split does not fit the checkpoint:\n  " + "\n  ".join(problems))
    tp, pp = int(layout["tensor_model_parallel_size"]), int(layout["pipeline_model_parallel_size"])
    missing = [str(ckpt.rank_file(source, t, s)) for t in range(tp) for s in range(pp)
               if not ckpt.rank_file(source, t, s).is_file()]
    if missing:
        raise ckpt.CheckpointError(f"{source} is incomplete: {', '.join(missing)} missing")
    final = ckpt.iteration_dir(save, iteration)
    if final.exists():
        raise ckpt.CheckpointError(f"{final} already exists; pick another --save directory or remove it")
    staging = final.with_name(final.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)  # a conversion of this iteration that was interrupted
    staging.mkdir(parents=True)
    try:
        with progress.step(f"converting {source} to layer split {format_layer_split(split)}", tp * pp) as step:
            for t in range(tp):
                files: dict[int, dict] = {}  # this TP rank's saved stage files, each read once

                def read(stage: int, t: int = t) -> dict:
                    if stage not in files:
                        files[stage] = ckpt.read_rank_file(ckpt.rank_file(source, t, stage))
                    return files[stage]

                for stage in range(pp):
                    payload = convert_rank_payload(read, stage, list(split))
                    ckpt.write_rank_file(ckpt.rank_file(staging, t, stage), payload)
                    step.update()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.replace(staging, final)
    ckpt.atomic_write_text(Path(save) / ckpt.TRACKER, f"{iteration}\n")
    return final, ckpt.saved_layer_split(layout)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        final, saved = convert(args.load, args.save, args.pipeline_layer_split, args.iteration,
                               reporter("convert_checkpoint", quiet=args.quiet))
    except ckpt.CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no converted checkpoint written", file=sys.stderr)
        return 130
    split = format_layer_split(args.pipeline_layer_split)
    print(f"converted {final.name} from layer split {format_layer_split(saved)} to {split} in "
          f"{time.monotonic() - started:.1f} s: {final}; resume with --load {args.save} --pipeline-layer-split {split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
