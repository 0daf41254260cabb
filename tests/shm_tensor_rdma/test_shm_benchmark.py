"""The P2P benchmark runs end to end and compares against Open MPI where it is installed.

A short run (small budget, sizes up to 1 MiB): the figures themselves are for the benchmark's
full run, not for a test; what is checked is that every column is measured in one invocation and
that the Open MPI reference builds and runs, or is skipped with the reason."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

from launch import ROOT, env

COMMAND = [sys.executable, "benchmarks/shm_p2p.py", "--compare-mpi", "--budget-mib", "8", "--max-size-mib", "1",
           "--latency-iters", "200"]


def test_benchmark_prints_ours_open_mpi_memcpy_and_gloo_side_by_side(tmp_path):
    proc = subprocess.run([*COMMAND, "--json", str(tmp_path / "runs.json")], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "transport=shm (single copy" in out or "transport=shm (two copies" in out, out
    rows = {m.group(1): m.group(2).split() for m in re.finditer(r"^\s*(\d+ (?:KiB|MiB|B))\s+(.*)$", out, re.M)}
    assert {"4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "8 B", "256 B"} <= set(rows), out
    have_mpi = shutil.which("mpicc") is not None and shutil.which("mpirun") is not None
    if have_mpi:
        assert "Open MPI: Open MPI v" in out and "single copy: " in out, out
        # size, C++, Python, Open MPI, C++/MPI, Py/MPI, memcpy, C++/memcpy, gloo, Py/gloo
        assert all(len(rows[s]) == 9 and all(float(x) > 0 for x in rows[s]) for s in ("64 KiB", "1 MiB")), out
        assert len(rows["8 B"]) == 6, out  # C++, send/recv, handles, Open MPI, gloo, ratio
    else:
        assert "Open MPI: column skipped: mpicc not found (install openmpi-bin libopenmpi-dev)" in out, out
        assert all(len(rows[s]) == 6 for s in ("64 KiB", "1 MiB")), out
