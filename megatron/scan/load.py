"""Loading a trace directory: every rank file parsed in parallel (processes: JSON parsing holds the
GIL), then merged into one columnar GlobalTrace with names and groups interned across ranks."""
from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron.app.progress import SILENT, Reporter
from megatron.scan.trace_format import RankFile, TraceFormatError, group_list, iter_trace_files, read_rank_file


class AggregateError(RuntimeError):
    """The trace directory cannot be aggregated; the message says why and what to do."""


@dataclass(kw_only=True)
class GlobalTrace:
    """All ranks' events in NumPy columns (one row per event). Times are wall-clock ns converted
    through each window's reference pair; `align` later adds per-rank corrections."""

    ranks: dict[int, dict[str, Any]]  # rank -> header
    windows: dict[int, list[dict[str, Any]]]  # rank -> window metadata
    names: list[str]
    groups: list[dict[str, Any]]  # gid -> {"name", "ranks", "desc"}
    columns: dict[str, np.ndarray]
    warnings: list[str] = field(default_factory=list)
    run_id: str = ""

    def __len__(self) -> int:
        return len(self.columns["rank"])

    def name_id(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            return -1

    def ids(self, names) -> np.ndarray:
        return np.array([i for i, n in enumerate(self.names) if n in set(names)], dtype=np.int64)

    def label(self, rank: int) -> str:
        c = self.ranks[rank]["coordinates"]
        role = self.ranks[rank].get("role")  # e.g. fwd / bwd when one logical rank is split (FBD)
        return f"DP{c['dp']}-PP{c['pp']}-TP{c['tp']}{f' {role}' if role else ''} (rank {rank})"


# What merge() keeps of a rank file's columns, in the types it keeps them in. The loading
# processes narrow the columns to these before sending them (72 bytes per event instead of 124:
# 1.3 GB instead of 2.3 for 4,096 ranks x 20 iterations, by the column sizes); the monotonic
# start_ns/end_ns are not merged (wall times are).
MERGED_TYPES = {"name": np.int32, "dtype": np.int32, "group": np.int32, "seq": np.int64, "bytes": np.int64,
                "start_wall_ns": np.int64, "end_wall_ns": np.int64,
                **{c: np.int32 for c in ("iteration", "microbatch", "chunk", "peer", "layer", "flags", "window")}}


def _read(path: str) -> RankFile | str:
    try:
        f = read_rank_file(path)
    except TraceFormatError as exc:
        return str(exc)
    f.columns = {column: f.columns[column].astype(kind, copy=False) for column, kind in MERGED_TYPES.items()}
    return f


def read_all(paths: list[Path], jobs: int | None = None, progress: Reporter = SILENT) -> list[RankFile | str]:
    """Parse files in parallel; an unreadable file comes back as its error message."""
    jobs = jobs or os.cpu_count() or 1
    jobs = min(jobs, len(paths))
    if jobs <= 1 or len(paths) < 4:
        return list(progress.iterate("loading rank files", (_read(str(p)) for p in paths), len(paths)))
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        results = pool.map(_read, [str(p) for p in paths], chunksize=max(1, len(paths) // (jobs * 4)))
        return list(progress.iterate("loading rank files", results, len(paths)))


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def retain_freed_memory() -> bool:
    """For the analysis processes (`detect`, `aggregate`, the online analysis), never a training
    process: keep the memory the analysis frees for its next arrays instead of giving it back to
    the kernel. glibc maps every array over 32 MB afresh and unmaps it when freed, so each of the
    hundreds of arrays of millions of rows faults its pages in again: 25 of the 59 s from 4,096
    ranks' files to a verdict were system time, 11 s with this (45 s in all, peak memory 5.5 GB
    instead of 5.2); one online analysis of 4,096 ranks took 6.7 s instead of 9.2. The price: the
    process keeps its peak memory between analyses. False where the C library is not glibc;
    nothing changes there."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Large arrays from the heap, and a free top of the heap kept up to 2 GB.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def load_directory(directory: str | os.PathLike, *, jobs: int | None = None, run_id: str | None = None,
                   progress: Reporter = SILENT) -> GlobalTrace:
    """Read every rank file of one run. Missing, corrupt or torn files are warned about by name and
    skipped; no readable file, or files of several runs without `run_id`, raise AggregateError.
    `progress` reports reading and merging the files (silent by default)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AggregateError(f"trace directory {directory} does not exist")
    paths = iter_trace_files(directory)
    if not paths:
        raise AggregateError(f"no trace files (benchmark-data-*.json) in {directory}; was the run started with --trace "
                             f"--trace-dir {directory}?")
    warnings: list[str] = []
    files: list[RankFile] = []
    for result in read_all(paths, jobs, progress):
        if isinstance(result, str):
            warnings.append(f"skipped {result}")
        else:
            files.append(result)
            warnings.extend(result.warnings)
    if not files:
        raise AggregateError(f"none of the {len(paths)} trace files in {directory} could be read:\n  "
                             + "\n  ".join(warnings))
    runs = collections.defaultdict(list)
    for f in files:
        runs[f.header["run_id"]].append(f)
    if run_id is not None:
        if run_id not in runs:
            raise AggregateError(f"no trace files of run {run_id} in {directory}; runs found: {', '.join(sorted(runs))}")
        files = runs[run_id]
    elif len(runs) > 1:
        listing = "\n".join(f"  run {rid}: " + ", ".join(Path(f.path).name for f in sorted(fs, key=lambda f: f.rank))
                            for rid, fs in sorted(runs.items()))
        raise AggregateError(f"{directory} mixes trace files of {len(runs)} different runs:\n{listing}\n"
                             f"pick one with --run-id, or give each run its own --trace-dir")
    attempts: dict[int, dict[int, RankFile]] = collections.defaultdict(dict)
    for f in sorted(files, key=lambda f: f.path):
        attempt = int(f.header.get("attempt", 0) or 0)
        earlier = attempts[f.rank].get(attempt)
        if earlier is not None:
            warnings.append(f"rank {f.rank} appears in both {earlier.path} and {f.path}; using the first")
            continue
        attempts[f.rank][attempt] = f
    by_rank: dict[int, RankFile] = {}
    for rank, of_rank in attempts.items():
        ordered = [of_rank[a] for a in sorted(of_rank)]
        by_rank[rank] = ordered[0] if len(ordered) == 1 else join_attempts(ordered, warnings)
    if any(len(of_rank) > 1 for of_rank in attempts.values()):
        by_rank = _common_windows(by_rank)
    warnings.extend(missing_ranks(int(next(iter(by_rank.values())).header["world_size"]), by_rank))
    _check_iterations(by_rank, warnings)
    for f in by_rank.values():
        if not f.ended:
            warnings.append(f"{f.path}: no end record (the rank stopped early or is still running); "
                            f"{len(f.windows)} complete window(s) used")
    trace = merge(by_rank, progress)
    trace.warnings = warnings + trace.warnings
    trace.run_id = next(iter(by_rank.values())).header["run_id"]
    return trace


def missing_ranks(world_size: int, present) -> list[str]:
    """The warning for ranks of the job with no trace file, if any."""
    missing = sorted(set(range(world_size)) - set(present))
    if not missing:
        return []
    return [f"no trace for rank(s) {_ranges(missing)} of {world_size}; continuing with the others "
            f"(their collectives will show fewer participants)"]


ATTEMPT_SEQ_SHIFT = 32  # a restarted attempt's sequence numbers follow every earlier attempt's (the matcher keeps 40 bits)


def join_attempts(files: list[RankFile], warnings: list[str] | None = None) -> RankFile:
    """One rank's files of successive torchrun attempts (restarts, `--max-restarts`) as one file:
    each attempt's iterations from the one its successor resumed at (loaded from the checkpoint)
    were rolled back, so they are dropped and the successor's kept. The header is the first
    attempt's with `restarts` listing each restart (attempt, iteration resumed at, wall time)."""
    names: dict[str, int] = {}
    groups: dict[tuple, int] = {}
    parts: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    windows: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    for k, f in enumerate(files):
        until = int(files[k + 1].header.get("start_iteration", 0)) if k + 1 < len(files) else None
        c = f.columns
        window_map = np.full(len(f.windows) + 1, -1, dtype=np.int64)
        for index, window in enumerate(f.windows):
            first, last = window["iterations"]
            if until is not None and first >= until:
                continue
            if until is not None and last >= until:
                window = {**window, "iterations": [first, until - 1]}
            window = {**window, "attempt": int(f.header.get("attempt", k) or 0)}
            window_map[index] = len(windows)
            windows.append(window)
        keep = window_map[c["window"]] >= 0
        if until is not None:
            keep &= c["iteration"] < until
            dropped = sorted(set(c["iteration"][~keep].tolist()) - {-1})
            if dropped and warnings is not None:
                warnings.append(f"rank {f.rank}: torchrun restarted the job from iteration {until}; iterations "
                                f"{_ranges(dropped)} of attempt {f.header.get('attempt', 0)} were rolled back "
                                f"(not kept by the model) and are left out")
        if k:
            restarts.append({"attempt": f.header.get("attempt", k), "start_iteration": f.header.get("start_iteration"),
                             "wall_ns": f.header.get("clock_reference", {}).get("wall_ns"), "pid": f.header.get("pid"),
                             "path": f.path})
        name_map = np.array([names.setdefault(n, len(names)) for n in f.names] + [-1], dtype=np.int64)
        group_map = np.array([groups.setdefault((g["name"], tuple(g["ranks"]), g["desc"]), len(groups))
                              for g in f.groups] + [-1], dtype=np.int64)
        for column, values in c.items():
            kept = values[keep]
            if column in ("name", "dtype"):
                kept = name_map[kept]
            elif column == "group":
                kept = group_map[kept]
            elif column == "window":
                kept = window_map[kept]
            elif column == "seq" and k:  # each attempt numbers its collectives and messages from 0 again
                kept = np.where(kept >= 0, kept + (int(f.header.get("attempt", k) or k) << ATTEMPT_SEQ_SHIFT), kept)
            parts[column].append(kept)
    columns = {column: np.concatenate(arrays) for column, arrays in parts.items()}
    last = files[-1]
    return RankFile(path=last.path, header={**files[0].header, "restarts": restarts}, windows=windows,
                    names=list(names), groups=group_list(groups), columns=columns, ended=last.ended,
                    warnings=[w for f in files for w in f.warnings])


def _common_windows(by_rank: dict[int, RankFile]) -> dict[int, RankFile]:
    """Window indices that mean the same window on every rank once attempts are joined (alignment
    fits one clock correction per window index): a window one rank lacks (the window in progress
    when a rank was killed is torn) becomes an empty one there, with the others' iterations."""
    def key(rank_file: RankFile, meta: dict) -> tuple[int, int]:
        return int(meta.get("attempt", rank_file.header.get("attempt", 0) or 0)), int(meta["window"])

    known: dict[tuple[int, int], dict] = {}
    for f in by_rank.values():
        for meta in f.windows:
            known.setdefault(key(f, meta), meta)
    order = {k: index for index, k in enumerate(sorted(known))}
    result = {}
    for rank, f in by_rank.items():
        own = {key(f, meta): meta for meta in f.windows}
        windows = [own.get(k) or {**known[k], "metrics": [], "dropped": 0, "empty": True} for k in sorted(known)]
        window_map = np.array([order[key(f, meta)] for meta in f.windows] + [-1], dtype=np.int64)
        columns = {**f.columns, "window": window_map[f.columns["window"]]}
        result[rank] = RankFile(path=f.path, header=f.header, windows=windows, names=f.names, groups=f.groups,
                                columns=columns, ended=f.ended, warnings=f.warnings)
    return result


def _check_iterations(by_rank: dict[int, RankFile], warnings: list[str]) -> None:
    traced = {rank: tuple(i for w in f.windows for i in range(w["iterations"][0], w["iterations"][1] + 1))
              for rank, f in by_rank.items()}
    if not traced:
        return
    common = collections.Counter(traced.values()).most_common(1)[0][0]
    for rank, iterations in sorted(traced.items()):
        if iterations != common:
            warnings.append(f"rank {rank} traced {len(iterations)} iteration(s) ({_ranges(iterations) or 'none'}) but "
                            f"most ranks traced {len(common)} ({_ranges(common) or 'none'}); "
                            f"instances outside the common iterations are incomplete")


def merge(by_rank: dict[int, RankFile], progress: Reporter = SILENT) -> GlobalTrace:
    """Concatenate per-rank columns, remapping each file's names and groups to global ids."""
    names: dict[str, int] = {}
    groups: dict[tuple, int] = {}
    dtypes = {"rank": np.int32, **MERGED_TYPES}
    parts: dict[str, list[np.ndarray]] = {column: [] for column in dtypes}
    for rank in progress.iterate("merging rank files", sorted(by_rank)):
        f = by_rank[rank]
        name_map = np.array([names.setdefault(n, len(names)) for n in f.names] + [-1], dtype=np.int32)
        group_map = np.array([groups.setdefault((g["name"], tuple(g["ranks"]), g["desc"]), len(groups))
                              for g in f.groups] + [-1], dtype=np.int32)
        c = f.columns
        parts["rank"].append(np.full(f.num_events, rank, dtype=np.int32))
        parts["name"].append(name_map[c["name"]])
        parts["dtype"].append(name_map[c["dtype"]])
        parts["group"].append(group_map[c["group"]])
        for column in MERGED_TYPES.keys() - {"name", "dtype", "group"}:
            parts[column].append(c[column].astype(MERGED_TYPES[column], copy=False))  # the loaders narrowed them
    # Concatenated: with the columns written into arrays made empty first, the matching that
    # follows took 5.5-7.0 s instead of 4.2 at 4,096 ranks (same values).
    columns = {column: np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtypes[column])
               for column, arrays in parts.items()}
    columns["start"] = columns.pop("start_wall_ns")
    columns["end"] = columns.pop("end_wall_ns")
    return GlobalTrace(ranks={r: f.header for r, f in sorted(by_rank.items())},
                       windows={r: f.windows for r, f in sorted(by_rank.items())},
                       names=list(names), groups=group_list(groups), columns=columns)


def _ranges(values) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    values = sorted(set(int(v) for v in values))
    out: list[str] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)
