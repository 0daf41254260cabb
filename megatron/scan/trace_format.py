"""The per-rank trace file: a JSON header line, then one self-contained JSON line per traced window
(columnar events), then an end line. Written append-only by a background thread; read back
into NumPy columns. Every module that produces timing writes this one format. The module is over 400
lines because the writer, the reader and what names a file (a rank, a role, a torchrun attempt)
must agree on that format, so they stay together."""
from __future__ import annotations

import base64
import binascii
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

try:  # window records are JSON arrays of millions of integers at scale: orjson parses them ~4x faster
    import orjson as _orjson
except ImportError:  # pragma: no cover - a dependency; the standard parser reads the same files
    _orjson = None

FORMAT = "megascan-trace"
# 2: event columns stored as "<code>:<base64>" strings (encode_column); 1: JSON arrays, still read.
VERSION = 2

# Integer event columns, in the order an event tuple holds them after its name. -1 means "not set".
# start_ns/end_ns are nanoseconds since the window's reference pair (clock.monotonic_ns).
INT_COLUMNS: tuple[str, ...] = (
    "start_ns", "end_ns", "iteration", "microbatch", "chunk", "bytes", "peer", "group", "seq", "layer", "flags",
)
# Columns holding an index into the window's `names` table.
NAME_COLUMNS: tuple[str, ...] = ("name", "dtype")
COLUMNS: tuple[str, ...] = ("name", *INT_COLUMNS, "dtype")

# Bits of the `flags` column.
FLAG_BACKWARD = 1  # a P2P message of the backward pass (gradient), else activation
FLAG_ASYNC = 2  # an async collective: `end_ns` is when it was issued, not when it finished
FLAG_DEVICE_TIME = 4  # timed by device events (CUDA), not the host clock
FLAG_INSTANT = 8  # a point event (start == end)


class TraceFormatError(ValueError):
    """A trace file cannot be read; the message names the file and what is wrong."""


def trace_file_name(dp: int, pp: int, tp: int, virtual: str | None = None, attempt: int = 0) -> str:
    """`benchmark-data-{dp}-pipeline-{pp}-tensor-{tp}.json` (the seed's naming, kept for its tools);
    `virtual` distinguishes several roles played by one physical rank (FBD); `attempt` > 0 is a
    torchrun restart of the job (`-attempt{N}`), whose file the loader joins to the earlier ones."""
    suffix = (f"-{virtual}" if virtual else "") + (f"-attempt{attempt}" if attempt else "")
    return f"benchmark-data-{dp}-pipeline-{pp}-tensor-{tp}{suffix}.json"


def elastic_identity(environ=os.environ) -> str | None:
    """What every attempt of one torchrun job shares on rank 0's node, and another job does not:
    torchrun's run id and store address, and the host and process id of the torchrun agent that
    starts rank 0 (the same agent restarts it); None outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    return (f"{environ['TORCHELASTIC_RUN_ID']}@{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}"
            f"/{host_identity()}/agent-{os.getppid()}")


def earlier_attempt(directory: str | os.PathLike, elastic_id: str | None, *, resumed: bool = False,
                    world_size: int = 0, sizes: dict | None = None) -> tuple[int, str] | None:
    """(attempt, run id) of the latest attempt of the run this job continues in `directory`, so its
    trace joins that run as the next attempt; None if it continues none. A run continues another
    when it is the same torchrun job (`elastic_id`: restarted by --max-restarts) or, `resumed` from a
    checkpoint, when the directory holds a run of the same layout (the same command run again after
    a failure, e.g. once space was freed): the latest such run."""
    same_job: tuple[int, str] | None = None
    runs: dict[str, tuple[int, int]] = {}  # run id -> (latest attempt, latest start wall ns)
    for path in iter_trace_files(directory):
        try:
            with open(path, "rb") as f:
                header = json.loads(f.readline())
        except (OSError, ValueError):
            continue
        if not isinstance(header, dict) or not isinstance(header.get("attempt", 0), int):
            continue
        attempt, run_id = header.get("attempt", 0), str(header.get("run_id"))
        if elastic_id is not None and header.get("elastic_id") == elastic_id:
            if same_job is None or attempt > same_job[0]:
                same_job = (attempt, run_id)
        elif resumed and header.get("world_size") == world_size and header.get("sizes") == sizes:
            wall = int(header.get("clock_reference", {}).get("wall_ns", 0))
            known = runs.get(run_id, (-1, 0))
            runs[run_id] = (max(known[0], attempt), max(known[1], wall))
    if same_job is not None:
        return same_job
    if runs:
        run_id, (attempt, _) = max(runs.items(), key=lambda item: item[1][1])
        return attempt, run_id
    return None


def clock_pair() -> dict[str, int]:
    """A wall-clock / monotonic reference pair. The wall read is bracketed by two monotonic reads
    and paired with their midpoint, so the pair is good to about a microsecond."""
    before = time.perf_counter_ns()
    wall = time.time_ns()
    after = time.perf_counter_ns()
    return {"wall_ns": wall, "monotonic_ns": (before + after) // 2}


@dataclass(kw_only=True, slots=True)
class WindowRecord:
    """One traced window as handed to the writer: events are tuples `(name, *INT_COLUMNS, dtype)`
    with absolute monotonic times; the writer makes them relative and columnar."""

    window: int
    iterations: tuple[int, int]  # first and last iteration in the window
    clock_start: dict[str, int]
    clock_end: dict[str, int]
    events: list[tuple]
    groups: dict[int, dict[str, Any]]  # group id -> {"name", "ranks", "desc"}
    metrics: list[dict[str, Any]] = field(default_factory=list)  # per iteration: time, loss
    resolve: Callable[[list[tuple]], list[tuple]] | None = None  # device events -> ns, off the hot path
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class ClockSkew:
    """Testing aid: makes one rank's host look as if its wall clock were `offset_ns` off and its
    monotonic clock ran `drift` (a fraction, 1e-4 = 100 ppm) fast, applied off the hot path."""

    offset_ns: int
    drift: float = 0.0
    reference_ns: int = 0  # monotonic time from which the drift accumulates

    def wall(self, t: int) -> int:
        return t + self.offset_ns

    def mono(self, t: int) -> int:
        return t + int(self.drift * (t - self.reference_ns))


# How a version-2 file stores an integer event column: "<code>:<base64>", the values little-endian
# in the narrowest of these types that holds them all. A JSON array makes the reader build a Python
# integer per value (the largest cost of reading thousands of ranks' windows); a string is copied
# once and decoded in C, and small columns (names, groups, flags) take a byte per value.
COLUMN_CODES: dict[str, np.dtype] = {code: np.dtype(f"<{code}") for code in ("i1", "i2", "i4", "i8")}
_CODE_RANGES = [(code, int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)) for code, dtype in COLUMN_CODES.items()]


def encode_column(values: Sequence[int] | np.ndarray) -> str:
    """One integer event column as stored in a window line (COLUMN_CODES)."""
    array = np.asarray(values, dtype=np.int64)
    low, high = (int(array.min()), int(array.max())) if array.size else (0, 0)
    code = next(code for code, smallest, largest in _CODE_RANGES if smallest <= low and high <= largest)
    return f"{code}:{base64.b64encode(array.astype(COLUMN_CODES[code]).tobytes()).decode('ascii')}"


def decode_column(stored: str | list) -> np.ndarray:
    """A stored event column as int64: an encode_column string, or a version-1 JSON array. Raises
    ValueError for anything else (an unknown code, base64 that is not, a length that is not whole
    values), as a malformed record must."""
    if isinstance(stored, list):
        return np.fromiter(stored, dtype=np.int64, count=len(stored))  # half the time of np.asarray
    if not isinstance(stored, str):
        raise ValueError(f"an event column stored as {type(stored).__name__}")
    code, _, text = stored.partition(":")
    dtype = COLUMN_CODES.get(code)
    if dtype is None:
        raise ValueError(f"an event column encoded as {code!r}, not one of {', '.join(COLUMN_CODES)}")
    raw = binascii.a2b_base64(text, strict_mode=True)
    if len(raw) % dtype.itemsize:
        raise ValueError(f"an event column of {len(raw)} bytes is not whole {code} values")
    return np.frombuffer(raw, dtype=dtype).astype(np.int64)


def encode_window(record: WindowRecord, skew: ClockSkew | None = None) -> bytes:
    """Turn a window into one JSON line: intern names, make times relative, store columns."""
    events = record.resolve(record.events) if record.resolve is not None else record.events
    clock_start = dict(record.clock_start)
    clock_end = dict(record.clock_end)
    if skew is not None:
        # Testing: pretend this rank's host clocks are off (see --trace-clock-skew).
        for pair in (clock_start, clock_end):
            pair["wall_ns"] = skew.wall(pair["wall_ns"])
            pair["monotonic_ns"] = skew.mono(pair["monotonic_ns"])
    names: dict[str, int] = {}
    base = record.clock_start["monotonic_ns"]
    columns: dict[str, Any] = {c: [] for c in COLUMNS}
    used_groups: list[int] = []
    if events:
        rows = list(zip(*events))
        # Interned in order of first use, event names before dtypes; a dict lookup per value.
        first_use = dict.fromkeys(rows[0])
        first_use.update(dict.fromkeys(rows[-1]))
        first_use.pop(None, None)
        names = {n: i for i, n in enumerate(first_use)}
        index = {**names, None: -1}.__getitem__
        columns["name"] = list(map(index, rows[0]))
        for i, column in enumerate(INT_COLUMNS, start=1):
            columns[column] = np.array(rows[i], dtype=np.int64)
        columns["dtype"] = list(map(index, rows[-1]))
        base_out = base
        if skew is not None:  # the pretended clock error, as on the reference pairs above
            columns["start_ns"] = np.array([skew.mono(int(t)) for t in columns["start_ns"]], dtype=np.int64)
            columns["end_ns"] = np.array([skew.mono(int(t)) for t in columns["end_ns"]], dtype=np.int64)
            base_out = clock_start["monotonic_ns"]
        columns["start_ns"] = columns["start_ns"] - base_out
        columns["end_ns"] = columns["end_ns"] - base_out
        used_groups = np.unique(columns["group"][columns["group"] >= 0]).tolist()  # sorted
    line = {
        "type": "window",
        "window": record.window,
        "iterations": list(record.iterations),
        "clock": {"start": clock_start, "end": clock_end},
        "names": list(names),
        "groups": {str(g): record.groups.get(g, {"name": f"unknown-{g}", "ranks": [], "desc": ""})
                   for g in used_groups},
        "metrics": record.metrics,
        "dropped": record.dropped,
        "events": {column: encode_column(values) for column, values in columns.items()},
    }
    return (json.dumps(line, separators=(",", ":")) + "\n").encode()


class TraceWriter:
    """Owns one rank's trace file. The header is written atomically (temp file + rename); each
    window is encoded and appended by a background thread with a single O_APPEND write, then
    fsync'd, so a crash loses at most the window being written and never tears earlier ones."""

    def __init__(self, path: str | os.PathLike, header: dict[str, Any],
                 skew: ClockSkew | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._skew = skew
        header = {"type": "header", "format": FORMAT, "version": VERSION, **header}
        if skew is not None:
            # The pretended clock error is a host's: this rank now stands for a host of its own.
            header["host_id"] = f"{header.get('host_id', '')}+clock-skew-rank{header.get('rank')}"
            reference = header["clock_reference"]
            header["clock_reference"] = {"wall_ns": skew.wall(reference["wall_ns"]),
                                         "monotonic_ns": skew.mono(reference["monotonic_ns"])}
        self.header = header
        self._write_header(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._submitted = False
        self._queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.stopped: str | None = None  # why writing stopped (a full disk), else None
        self.windows_written = 0
        self.bytes_written = 0
        self.encode_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="megascan-writer", daemon=True)
        self._thread.start()

    def _write_header(self, path: Path) -> None:
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as f:
            f.write((json.dumps(self.header, separators=(",", ":")) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)

    def update_header(self, fields: dict[str, Any], path: str | os.PathLike | None = None) -> bool:
        """Before the first window: merge `fields` into the header (what a program only reveals once
        it runs, e.g. its parallel layout) and optionally move the file to `path`. The new file is
        complete before the old one goes. Returns False, changing nothing, once a window was submitted."""
        if self._submitted or self._fd < 0:
            return False
        new_path = Path(path) if path is not None else self.path
        self.header = {**self.header, **fields}
        self._write_header(new_path)
        os.close(self._fd)
        if new_path != self.path:
            self.path.unlink(missing_ok=True)
            self.path = new_path
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return True

    @property
    def final(self) -> bool:
        """The header and path will not change any more: a window was submitted, or it closed."""
        return self._submitted or self._fd < 0

    def submit(self, record: WindowRecord) -> None:
        self._submitted = True
        self._queue.put(record)

    def _append(self, data: bytes) -> None:
        """One whole line or nothing: a write that fails part way (a full disk) is cut back off, so
        the file stays readable, and the writer stops (`stopped`): training goes on untraced."""
        if self.stopped is not None:
            return
        before = os.lseek(self._fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            os.fsync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, before)  # frees what the torn line took
            except OSError:
                pass
            self.stopped = f"{self.path}: {exc.strerror or exc}"
            print(f"[megascan] rank {self.header.get('rank')}: tracing stopped, writing {self.stopped}; training "
                  f"goes on untraced, and the file keeps its {self.windows_written} complete window(s)",
                  file=sys.stderr, flush=True)
            return
        self.bytes_written += len(data)
        self.windows_written += data.startswith(b'{"type":"window"')

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.stopped is not None:  # the disk filled: nothing more is encoded or written
                continue
            try:
                started = time.perf_counter()
                if isinstance(item, WindowRecord):
                    data = encode_window(item, self._skew)
                else:
                    if item.get("type") == "end":  # the writer's own CPU cost, for the overhead benchmark
                        item["writer_encode_s"] = round(self.encode_seconds, 6)
                    data = (json.dumps(item, separators=(",", ":")) + "\n").encode()
                self.encode_seconds += time.perf_counter() - started
                self._append(data)
            except BaseException as exc:  # keep training alive; report at close
                self.error = exc

    def close(self, end_record: dict[str, Any] | None = None, timeout: float = 60.0) -> None:
        """Drain the queue, append the end line and close the file."""
        if self._fd < 0:
            return
        if end_record is not None:
            self._queue.put({"type": "end", **end_record})
        self._queue.put(None)
        self._thread.join(timeout)
        os.close(self._fd)
        self._fd = -1


# ------------------------------------------------------------------------------------ reading


@dataclass(kw_only=True, slots=True)
class RankFile:
    """One rank's trace read back: header, window metadata and NumPy event columns. Names and
    groups are interned per file (`names`, `groups`); `columns["window"]` is the window index."""

    path: str
    header: dict[str, Any]
    windows: list[dict[str, Any]]
    names: list[str]
    groups: list[dict[str, Any]]
    columns: dict[str, np.ndarray]
    ended: bool
    warnings: list[str]

    @property
    def rank(self) -> int:
        return int(self.header["rank"])

    @property
    def num_events(self) -> int:
        return len(self.columns["name"])


def read_rank_file(path: str | os.PathLike) -> RankFile:
    """Parse one trace file. A torn last line (the window in progress at a crash) is dropped with
    a warning; anything else unreadable raises TraceFormatError naming the file and line."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read ({exc.strerror})") from None
    if lines and lines[-1] == b"":
        lines.pop()
    if not lines:
        raise TraceFormatError(f"{path}: empty file, not a MegaScan trace")
    header = parse_header(path, lines[0])
    warnings: list[str] = []
    names: dict[str, int] = {}
    groups: dict[tuple, int] = {}
    windows: list[dict[str, Any]] = []
    parts: dict[str, list[np.ndarray]] = {c: [] for c in (*COLUMNS, "window", "start_wall_ns", "end_wall_ns")}
    ended = False
    for number, raw in enumerate(lines[1:], start=2):
        try:
            record = parse_record(raw, names, groups)
        except RECORD_ERRORS as exc:
            if number == len(lines):
                warnings.append(f"{path}: last line (window in progress when the rank stopped) is torn; ignored")
                break
            raise TraceFormatError(f"{path}: line {number} is not a valid window record ({exc!r:.80})") from None
        if record["type"] == "end":
            ended = True
        if record["type"] != "window":
            continue
        record["columns"]["window"][:] = len(windows)
        for column, values in record["columns"].items():
            parts[column].append(values)
        windows.append(record["meta"])
    columns = {c: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64)) for c, v in parts.items()}
    return RankFile(path=path, header=header, windows=windows, names=list(names), groups=group_list(groups),
                    columns=columns, ended=ended, warnings=warnings)


def parse_header(path: str, raw: bytes) -> dict[str, Any]:
    """A trace file's first line, checked: TraceFormatError says what is wrong with it."""
    try:
        header = json.loads(raw)
    except ValueError:  # JSONDecodeError, or bytes that are not text at all
        raise TraceFormatError(f"{path}: first line is not JSON, not a MegaScan trace") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceFormatError(f"{path}: not a MegaScan trace (no '\"format\": \"{FORMAT}\"' header)")
    if header.get("version", 0) > VERSION:
        raise TraceFormatError(f"{path}: trace format version {header['version']} is newer than this reader ({VERSION})")
    for key in ("rank", "world_size", "run_id"):
        if key not in header:
            raise TraceFormatError(f"{path}: header lacks {key!r}")
    return header


def group_list(groups: dict[tuple, int]) -> list[dict[str, Any]]:
    """Groups interned as {(name, ranks, desc): id} (parse_record's `groups`), listed by id."""
    listed: list[dict[str, Any]] = [{}] * len(groups)
    for (name, ranks, desc), index in groups.items():
        listed[index] = {"name": name, "ranks": list(ranks), "desc": desc}
    return listed


# What a line that is not a valid record raises while parse_record reads it.
RECORD_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError)


def parse_record(raw: bytes, names: dict[str, int], groups: dict[tuple, int]) -> dict[str, Any]:
    """One line after the header, as {"type": ...}; a window's also holds its metadata (`meta`)
    and event columns (`columns`, window index 0), its names and groups interned into the file's
    `names` and `groups`. Raises one of RECORD_ERRORS for a line that is not a valid record."""
    record = _parse_line(raw)
    kind = record.get("type")
    if kind != "window":
        return {"type": kind}
    meta = {k: record[k] for k in ("window", "iterations", "clock", "metrics", "dropped")}
    staged: dict[str, list[np.ndarray]] = {c: [] for c in (*COLUMNS, "window", "start_wall_ns", "end_wall_ns")}
    _append_window(record, names, groups, staged)
    return {"type": kind, "meta": meta, "columns": {c: v[0] for c, v in staged.items()}}


def _parse_line(raw: bytes) -> Any:
    """One JSON line. orjson where it can; the standard parser for what orjson refuses but the
    writer may emit (NaN and Infinity in metrics, integers beyond 64 bits), and for its errors."""
    if _orjson is not None:
        try:
            return _orjson.loads(raw)
        except _orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def _append_window(record: dict, names: dict[str, int], groups: dict[tuple, int],
                   parts: dict[str, list[np.ndarray]]) -> None:
    events = record["events"]
    name = decode_column(events["name"])
    count = len(name)
    local_names = np.array([names.setdefault(n, len(names)) for n in record["names"]] + [-1], dtype=np.int32)
    group_map = np.full(1 + max([int(k) for k in record["groups"]] + [0]) + 1, -1, dtype=np.int32)
    for key, info in record["groups"].items():
        identity = (info["name"], tuple(info["ranks"]), info.get("desc") or "")
        group_map[int(key)] = groups.setdefault(identity, len(groups))
    for column in INT_COLUMNS:
        parts[column].append(_integers(events[column], count))
    # -1 indexes the sentinel appended above, so unset names and groups stay -1.
    parts["name"].append(local_names[name])
    parts["dtype"].append(local_names[_integers(events["dtype"], count)])
    parts["group"][-1] = group_map[parts["group"][-1]].astype(np.int64)
    parts["window"].append(np.zeros(count, dtype=np.int32))  # the reader numbers the windows
    # Monotonic -> wall clock through this window's own reference pair.
    wall_base = record["clock"]["start"]["wall_ns"]
    parts["start_wall_ns"].append(parts["start_ns"][-1] + wall_base)
    parts["end_wall_ns"].append(parts["end_ns"][-1] + wall_base)


def _integers(stored: str | list, count: int) -> np.ndarray:
    """A stored column of `count` integers as int64; one of another length raises ValueError, as
    a malformed record must."""
    values = decode_column(stored)
    if len(values) != count:
        raise ValueError(f"a column of {len(values)} values in a window of {count} events")
    return values


def header_fields(*, rank: int, world_size: int, run_id: str, coordinates: dict[str, int],
                  sizes: dict[str, int], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The header every producer writes (the tracer, the synthetic generator, later the launcher)."""
    import socket

    return {
        "run_id": run_id,
        "rank": rank,
        "world_size": world_size,
        "coordinates": coordinates,  # {"dp", "pp", "tp"}
        "sizes": sizes,  # {"dp", "pp", "tp", ...}
        "host": socket.gethostname(),
        "host_id": host_identity(),
        "pid": os.getpid(),
        "clock_reference": clock_pair(),
        **(extra or {}),
    }


def host_identity() -> str:
    """`hostname/boot_id`: ranks with equal identities read one wall clock, so alignment fits one
    correction per identity. The boot id (one per kernel boot) tells a rebooted host, or two hosts
    that happen to share a name, apart; the host name tells two containers on one kernel apart
    (they share the clock, so that only costs an unknown the anchors then fit at about 0)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def iter_trace_files(directory: str | os.PathLike) -> list[Path]:
    """Candidate rank files in a trace directory, sorted by name."""
    return sorted(p for p in Path(directory).glob("benchmark-data-*.json") if p.is_file())


def write_lines(path: str | os.PathLike, lines: Iterable[dict[str, Any]]) -> None:
    """Write a whole trace file at once (used by the synthetic generator and tests)."""
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def window_line(*, window: int, iterations: Sequence[int], clock_start: dict, clock_end: dict, names: list[str],
                groups: dict[str, dict], events: dict[str, list], metrics: list | None = None) -> dict[str, Any]:
    """A window record as a dict, from columns already relative and interned (for generators),
    stored as the writer stores them."""
    return {"type": "window", "window": window, "iterations": list(iterations),
            "clock": {"start": clock_start, "end": clock_end}, "names": names, "groups": groups,
            "metrics": metrics or [], "dropped": 0,
            "events": {column: encode_column(values) for column, values in events.items()}}
