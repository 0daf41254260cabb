"""A trace directory that fills up mid-run (a small tmpfs): each rank stops tracing with one warning
naming its file, training finishes, and every trace file stays readable with the windows written
before the disk filled (a window cut off part way is removed, not left torn in the middle)."""
from __future__ import annotations

import subprocess

import pytest

from conftest import train
from megatron.scan.trace_format import iter_trace_files, read_rank_file


def test_a_full_trace_disk_stops_tracing_and_training_goes_on(tmp_path):
    mount = tmp_path / "trace"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root / CAP_SYS_ADMIN): {made.stderr.strip()}")
    try:
        proc = train(mount, ["--tensor-model-parallel-size", "2"], [], iters=20)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert " iteration       20/" in proc.stdout
        stopped = [line for line in proc.stderr.splitlines() if "tracing stopped" in line]
        assert stopped and all("No space left on device" in line and "training goes on" in line for line in stopped)
        windows = []
        for path in iter_trace_files(mount):
            rank = read_rank_file(path)  # raises on a torn line anywhere but the last
            assert not rank.warnings, rank.warnings
            windows.append(len(rank.windows))
        assert len(windows) == 4 and max(windows) >= 1 and min(windows) < 4, windows  # 20 dense iterations: 4
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
