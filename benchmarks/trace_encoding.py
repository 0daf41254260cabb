"""What storing event columns as encoded strings (trace format version 2) changes against JSON
arrays (version 1), on trace files you have: bytes per window line, the reader's time per line
(`trace_format.parse_record`, what every analysis and online detection's reader run) and the
writer's (`encode_window`, which the tracer's background thread runs after each traced window;
for version 1 the same function storing each column as a JSON array).
Every window line of the files is taken in both forms; the columns read back equal in both.

    python -m megatron.scan synthesize /tmp/job --tp 8 --pp 8 --dp 8 --iterations 20 --window 5
    python benchmarks/trace_encoding.py /tmp/job [--files 256]
    python benchmarks/trace_encoding.py /tmp/trace_run      # a trainer or launch run's --trace-dir

Prints a Markdown table (medians of --repeat timings) and one JSON line."""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron.scan.trace_format as trace_format  # noqa: E402
from megatron.scan.trace_format import (  # noqa: E402
    COLUMNS,
    INT_COLUMNS,
    WindowRecord,
    decode_column,
    encode_window,
    group_list,
    iter_trace_files,
    parse_record,
)


def window_lines(paths: list[Path]) -> list[bytes]:
    """Every window line of the files, as stored."""
    lines = []
    for path in paths:
        with open(path, "rb") as f:
            lines.extend(line for line in f if b'"window"' in line[:24])
    return lines


def both_forms(line: bytes) -> tuple[bytes, bytes, WindowRecord]:
    """(version-1 line, version-2 line, the window as the tracer hands it to the writer)."""
    names: dict[str, int] = {}
    groups: dict[tuple, int] = {}
    record = parse_record(line, names, groups)
    columns, meta = record["columns"], record["meta"]
    raw = json.loads(line)
    name_of = list(names) + [None]  # -1 -> None
    listed = group_list(groups)
    base = meta["clock"]["start"]["monotonic_ns"]
    events = list(zip(
        [name_of[i] for i in columns["name"].tolist()],
        *[(columns[c] + base if c in ("start_ns", "end_ns") else columns[c]).tolist() for c in INT_COLUMNS],
        [name_of[i] for i in columns["dtype"].tolist()]))
    window = WindowRecord(window=meta["window"], iterations=tuple(meta["iterations"]),
                          clock_start=meta["clock"]["start"], clock_end=meta["clock"]["end"], events=events,
                          groups=dict(enumerate(listed)), metrics=meta["metrics"], dropped=meta["dropped"])
    version_1 = dict(raw, events={c: decode_column(raw["events"][c]).tolist() for c in COLUMNS})
    return (json.dumps(version_1, separators=(",", ":")) + "\n").encode(), encode_window(window), window


@contextlib.contextmanager
def writing_arrays():
    """encode_window storing each column as a JSON array, as version 1 did."""
    encode = trace_format.encode_column
    trace_format.encode_column = lambda values: np.asarray(values, dtype=np.int64).tolist()
    try:
        yield
    finally:
        trace_format.encode_column = encode


def timed(work, items, repeat: int) -> float:
    """Median over `repeat` passes of the seconds one pass over `items` takes."""
    passes = []
    for _ in range(repeat):
        started = time.perf_counter()
        for item in items:
            work(item)
        passes.append(time.perf_counter() - started)
    return statistics.median(passes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="a trace directory (benchmark-data-*.json; only read)")
    parser.add_argument("--files", type=int, default=256, help="rank files taken, spread over the directory "
                                                               "(default 256; 0: all)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes; medians are printed (default 3)")
    args = parser.parse_args(argv)
    paths = iter_trace_files(args.directory)
    if not paths:
        parser.error(f"{args.directory}: no benchmark-data-*.json trace files")
    if args.files and len(paths) > args.files:
        paths = [paths[i] for i in np.linspace(0, len(paths) - 1, args.files).round().astype(int)]
    print(f"reading {len(paths)} rank files of {args.directory} ...", file=sys.stderr, flush=True)
    forms = [both_forms(line) for line in window_lines(paths)]
    if not forms:
        parser.error(f"{args.directory}: no window lines in its trace files")
    old, new, windows = ([f[i] for f in forms] for i in range(3))
    for a, b in zip(old, new):  # both forms hold the same columns (names and groups interned alike)
        names: dict[str, int] = {}
        groups: dict[tuple, int] = {}
        ca, cb = parse_record(a, names, groups)["columns"], parse_record(b, names, groups)["columns"]
        assert all(np.array_equal(ca[c], cb[c]) for c in ca), "the two forms read back differently"
    events = sum(len(w.events) for w in windows)
    figures = {
        "lines": len(forms), "events": events,
        "bytes_v1": sum(map(len, old)), "bytes_v2": sum(map(len, new)),
        "read_s_v1": timed(lambda line: parse_record(line, {}, {}), old, args.repeat),
        "read_s_v2": timed(lambda line: parse_record(line, {}, {}), new, args.repeat),
        "write_s_v2": timed(encode_window, windows, args.repeat),
    }
    with writing_arrays():
        assert json.loads(encode_window(windows[0]))["events"]["start_ns"] == json.loads(old[0])["events"]["start_ns"]
        figures["write_s_v1"] = timed(encode_window, windows, args.repeat)
    per_line = {key: value / len(forms) for key, value in figures.items() if key.endswith(("_v1", "_v2"))}
    print("| per window line (mean) | version 1 (JSON arrays) | version 2 (encoded columns) | ratio |")
    print("|---|---|---|---|")
    print(f"| bytes | {per_line['bytes_v1']:,.0f} | {per_line['bytes_v2']:,.0f} | "
          f"{figures['bytes_v2'] / figures['bytes_v1']:.2f} |")
    print(f"| read ms (parse_record) | {per_line['read_s_v1'] * 1e3:.3f} | {per_line['read_s_v2'] * 1e3:.3f} | "
          f"{figures['read_s_v2'] / figures['read_s_v1']:.2f} |")
    print(f"| write ms (encode_window) | {per_line['write_s_v1'] * 1e3:.3f} | "
          f"{per_line['write_s_v2'] * 1e3:.3f} | {figures['write_s_v2'] / figures['write_s_v1']:.2f} |")
    print(f"{len(forms)} window lines of {len(paths)} files, {events / len(forms):,.0f} events per line on average")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
