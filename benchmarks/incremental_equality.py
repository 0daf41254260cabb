"""Does online detection's window-by-window input equal a load of the whole directory? Each trace
directory given is grown window by window in a scratch directory (every file's first 1, 2, ...
windows); at each step the window-by-window input (megatron.scan.detect.incremental) and a
whole load of the same files are built, and their tables and the detectors' output compared.

    python -m pytest tests/scan --basetemp /tmp/suite        # leaves the suite's trace directories
    python benchmarks/incremental_equality.py $(find /tmp/suite -name 'benchmark-data-*.json' -printf '%h\\n' | sort -u)

Prints each prefix that differs and a summary line: directories, prefixes compared, prefixes with
identical tables and identical detection output, directories the window-by-window input reads
whole instead (a torchrun restart's attempts, files of several runs, an unreadable file), and
prefixes whose compute statistics were joined from each window's (compared with those of the
whole load's rows among the tables)."""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.scan.aggregate import aggregate  # noqa: E402
from megatron.scan.detect import detect  # noqa: E402
from megatron.scan.detect.incremental import WindowedInput, differences  # noqa: E402
from megatron.scan.detect.model import from_aggregation  # noqa: E402
from megatron.scan.detect.report import as_dict  # noqa: E402
from megatron.scan.load import AggregateError  # noqa: E402

WINDOW = b'{"type":"window"'


def verdict(data) -> str:
    report = as_dict(detect(data))
    report.pop("notes", None)  # a whole load also notes each rank's missing end record
    return json.dumps(report, default=str)  # in order: the report's lists and dicts as written


def main(directories: list[str]) -> int:
    summary = {"directories": 0, "prefixes": 0, "same_tables": 0, "same_detection": 0, "read_whole": 0,
               "compute_statistics_by_window": 0}
    for directory in directories:
        files = sorted(Path(directory).glob("benchmark-data-*.json"))
        if not files:
            continue
        lines = {f.name: f.read_bytes().split(b"\n") for f in files}
        windows = max(sum(1 for line in file_lines if line.startswith(WINDOW)) for file_lines in lines.values())
        scratch = Path(tempfile.mkdtemp(prefix="incremental-equality-"))
        source = WindowedInput(scratch)
        summary["directories"] += 1
        try:
            for prefix in range(1, windows + 1):
                for name, file_lines in lines.items():
                    kept, seen = [file_lines[0]], 0
                    for line in file_lines[1:]:
                        seen += line.startswith(WINDOW)
                        if seen > prefix:
                            break
                        if line:
                            kept.append(line)
                    (scratch / name).write_bytes(b"\n".join(kept) + b"\n")
                try:
                    whole = from_aggregation(aggregate(scratch, None, jobs=1))
                except AggregateError as exc:
                    print(f"{directory} window {prefix}: not loadable whole ({str(exc)[:100]})")
                    continue
                data = source.build()
                if data is None:
                    summary["read_whole"] += 1
                    print(f"{directory}: read whole ({source.unusable})")
                    break
                summary["prefixes"] += 1
                summary["compute_statistics_by_window"] += data.compute_stats is not None
                bad = differences(data, whole)
                same = verdict(data) == verdict(whole)
                summary["same_tables"] += not bad
                summary["same_detection"] += same
                if bad or not same:
                    print(f"{directory} window {prefix}: tables differ {bad}, detection {'same' if same else 'DIFFERS'}")
        except Exception:  # noqa: BLE001 - reported, and the next directory compared
            print(f"{directory}: failed")
            traceback.print_exc()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(summary))
    return 0 if summary["same_tables"] == summary["same_detection"] == summary["prefixes"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
