"""Reading a trace directory while the job writes it: each poll parses only the lines appended
since the last one (online detection; a whole-directory re-read before every analysis took
9.4 of 29 s at 4,096 ranks and grew with the run). A line still being written waits for its
newline. What a file holds is kept per window, so that a window read once is never parsed again
and its events can be let go once they are analysed."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron.scan.load import MERGED_TYPES
from megatron.scan.trace_format import (RECORD_ERRORS, RankFile, TraceFormatError, group_list, parse_header,
                                        parse_record)


@dataclass(kw_only=True)
class RankTail:
    """One rank file read so far: its header, every window's metadata, and the event columns of
    the windows not yet let go (`columns[k]` is None once released)."""

    path: str
    offset: int = 0  # bytes consumed (up to the last newline read)
    pending: bytes = b""  # an unfinished last line
    lines: int = 0  # complete lines read
    header: dict[str, Any] | None = None
    names: dict[str, int] = field(default_factory=dict)
    groups: dict[tuple, int] = field(default_factory=dict)
    windows: list[dict[str, Any]] = field(default_factory=list)
    columns: list[dict[str, np.ndarray] | None] = field(default_factory=list)
    ended: bool = False
    error: str | None = None  # why the file cannot be read (the full loader then skips it, saying so)
    keep_events: bool = True  # False: windows are counted and described, their events not kept
    forgotten: int = 0  # windows before this one are let go, their metadata too (`forget`)

    def poll(self) -> None:
        if self.error is not None or self.ended:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                appended = f.read()
        except OSError as exc:
            self.error = f"{self.path}: cannot read ({exc.strerror})"
            return
        self.offset += len(appended)
        lines = (self.pending + appended).split(b"\n")
        self.pending = lines.pop()
        for raw in lines:
            self._line(raw)
            if self.error is not None:
                return

    def _line(self, raw: bytes) -> None:
        self.lines += 1
        if self.header is None:
            try:
                self.header = parse_header(self.path, raw)
            except TraceFormatError as exc:
                self.error = str(exc)
            return
        try:
            record = parse_record(raw, self.names, self.groups)
        except RECORD_ERRORS as exc:
            self.error = f"{self.path}: line {self.lines} is not a valid window record ({exc!r:.80})"
            return
        if record["type"] == "end":
            self.ended = True
        elif record["type"] == "window":
            self.windows.append(record["meta"])
            self.columns.append({c: record["columns"][c].astype(kind, copy=False) for c, kind in MERGED_TYPES.items()}
                                if self.keep_events else None)

    def part(self, first: int, last: int) -> RankFile:
        """Windows first .. last-1 as a RankFile of their own (window indices from 0), in the
        loaders' narrowed columns; `first` must not have been released."""
        chosen = self.columns[first:last]
        if any(c is None for c in chosen):
            raise ValueError(f"{self.path}: windows before {first + chosen.index(None) + 1} were released")
        columns = {name: (chosen[0][name] if len(chosen) == 1 else np.concatenate([c[name] for c in chosen])) if chosen
                   else np.zeros(0, dtype=kind) for name, kind in MERGED_TYPES.items()}  # one window: not copied
        if chosen:
            columns["window"] = np.repeat(np.arange(len(chosen), dtype=np.int32), [len(c["window"]) for c in chosen])
        return RankFile(path=self.path, header=self.header, windows=self.windows[first:last], names=list(self.names),
                        groups=group_list(self.groups), columns=columns, ended=self.ended and last >= len(self.windows),
                        warnings=[])

    def release(self, before: int) -> None:
        """Let go of the events of windows 0 .. before-1 (their metadata stays)."""
        for k in range(min(before, len(self.columns))):
            self.columns[k] = None

    def forget(self, before: int) -> None:
        """Let go of windows 0 .. before-1 entirely: their events, and of their metadata all but
        the window and iteration numbers (the per-iteration metrics grow with a long run)."""
        for k in range(self.forgotten, min(before, len(self.windows))):
            self.columns[k] = None
            self.windows[k] = {"window": self.windows[k].get("window"), "iterations": self.windows[k]["iterations"]}
        self.forgotten = max(self.forgotten, min(before, len(self.windows)))


class DirectoryTail:
    """Every rank file of a trace directory, read incrementally (`poll`), new files included."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.files: dict[str, RankTail] = {}  # file name -> its tail
        self.keep_events = True

    def drop_events(self) -> None:
        """From now on only count and describe windows (their reader loads the files itself)."""
        self.keep_events = False
        for tail in self.files.values():
            tail.keep_events = False
            tail.release(len(tail.columns))

    def poll(self) -> dict[str, RankTail]:
        for path in sorted(self.directory.glob("benchmark-data-*.json")):
            if path.name not in self.files and path.is_file():
                self.files[path.name] = RankTail(path=str(path), keep_events=self.keep_events)
        for tail in self.files.values():
            tail.poll()
        return self.files

    def counts(self) -> dict[str, int]:
        """Complete windows per file so far."""
        return {name: len(tail.windows) for name, tail in self.poll().items()}

    def wait_for(self, world_size: int, windows: int, wait_s: float, poll_s: float = 0.02) -> None:
        """Until every rank's file holds `windows` windows (other ranks' writers append theirs a
        little after rank 0), or `wait_s` passed: then the analysis goes on with what is there.
        Polled often: a poll reads only appended bytes, and every quarter second of waiting was a
        quarter second of alert latency (about one window of a 4-rank CPU run)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            counts = self.counts()
            if len(counts) >= world_size and min(counts.values()) >= windows:
                return
            time.sleep(poll_s)
