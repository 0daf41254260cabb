"""Open MPI reference for benchmarks/shm_p2p.py: the same two measurements, made by Open MPI.

What is measured (by benchmarks/mpi_p2p.c, two ranks on this host, started by `mpirun -np 2`):

* stream: rank 0 sends `iters` messages of `size` bytes with MPI_Isend, keeping `window` in
  flight; rank 1 keeps `window` MPI_Irecv posted, re-posting each as it completes, cycling through
  `window` distinct buffers on both sides; then rank 1 sends a one-byte ack. Timed on rank 0 from
  right after an MPI_Barrier until the ack arrived, after one untimed pass of max(2, iters/8)
  messages; all buffers are memset (pages faulted in) before anything is timed. This is
  shm_p2p.py's stream() step for step: same window rule, same buffer cycling, same end point (the
  receiver's acknowledgement), same warm-up length.
* latency: ping-pong of `size` bytes with blocking MPI_Send/MPI_Recv, max(10, iters/10) untimed
  round trips, then `iters` timed; one-way latency = elapsed / (2 * iters), as ping_pong() there.

Why it is a fair reference: Open MPI's shared-memory path is what HPC codes get for intra-node
point-to-point, tuned over many years, and it is restricted here to exactly that path -- the ob1
PML over the `vader` BTL (plus `self` for a rank's messages to itself), no network transport --
with Open MPI's own defaults otherwise: eager copy-in/copy-out through a shared segment for small
messages, and for large ones vader's single-copy mechanism ("cma": the receiver reads the sender's
buffer with process_vm_readv, one copy instead of two) whenever ompi_info reports it. That
mechanism is left at its default and reported as result["single_copy"]. Ranks are not bound to
cores (`--bind-to none`), as the Python benchmark's processes are not. It is plain C with no
Python, torch or GIL in the way, so it is an upper reference for what a copy-based transport
between two processes reaches on this machine, not a like-for-like library comparison.

    from mpi_reference import find_or_build, run       # from benchmarks/ (shm_p2p.py as a script)
    from benchmarks.mpi_reference import find_or_build, run   # from the repository root

    exe, why = find_or_build()
    result, why = run(exe, stream=[(4096, 4000, 16)], latency=[(8, 2000)]) if exe else (None, why)

    python benchmarks/mpi_reference.py   # builds, runs shm_p2p.py's sizes, prints a table
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("mpi_p2p.c")
COMPILE = ["-O2"]  # mpicc flags; part of the cache key with the source

# Open MPI selection, passed as `--mca` on mpirun's command line (it overrides OMPI_MCA_* from the
# caller's environment and the system's openmpi-mca-params.conf, so the result does not depend on
# either):
#   pml ob1        the PML that drives BTLs. Without it Open MPI prefers pml ucx where UCX is
#                  installed, and UCX brings its own shared-memory transports (and probes IB/RoCE
#                  devices, complaining in containers without them); Debian's
#                  /etc/openmpi/openmpi-mca-params.conf happens to exclude ucx already.
#   btl self,vader vader is Open MPI's shared-memory BTL (same host); self carries a rank's
#                  messages to itself. Listing only these keeps tcp (loopback), openib and ofi
#                  out: no network device is probed and nothing can fall back to sockets, so a
#                  shared-memory failure is an error rather than a silently slower number.
# The single-copy mechanism (btl_vader_single_copy_mechanism) is left at Open MPI's default.
MCA = [("pml", "ob1"), ("btl", "self,vader")]

# What vader prints when its single-copy read fails (CMA blocked, e.g. seccomp without
# CAP_SYS_PTRACE in a container): then run() retries once with single_copy_mechanism none.
_CMA_FAILURE = re.compile(r"process_vm_(readv|writev)|(Read|Wrote) -?\d+, expected \d+|\bCMA\b")
# What vader prints when it finds at start-up that CMA cannot work (ptrace restrictions, another
# user namespace) and falls back by itself: the run succeeds, without single copy.
_CMA_FALLBACK = re.compile(r"CMA support\s+is\s+not\s+available|different user namespace", re.IGNORECASE)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-app" / "mpi_p2p"


def _tail(text: str, lines: int = 12) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip() and not set(line.strip()) <= {"-"}]
    return "\n".join(kept[-lines:])


def find_or_build(cache_dir: Path | None = None) -> tuple[Path | None, str]:
    """(path of the mpi_p2p executable, "") or (None, why not). Compiles benchmarks/mpi_p2p.c with
    `mpicc -O2` into `cache_dir/<hash>/mpi_p2p` (default ~/.cache/megatron-app/mpi_p2p), keyed by
    the source's SHA-256 and the flags, so an edited .c is rebuilt and an unchanged one is not."""
    mpicc = shutil.which("mpicc")
    if mpicc is None:
        return None, "mpicc not found (install openmpi-bin libopenmpi-dev)"
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        return None, f"cannot read {SOURCE}: {exc}"
    key = hashlib.sha256(source + "\0".join(COMPILE).encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    exe = folder / key / "mpi_p2p"
    if exe.is_file() and os.access(exe, os.X_OK):
        return exe, ""
    try:
        exe.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"cannot create the build cache {exe.parent}: {exc}"
    # Build under a temporary name and rename: concurrent builds never see a half-written binary.
    fd, tmp_name = tempfile.mkstemp(prefix="mpi_p2p.", suffix=".tmp", dir=exe.parent)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([mpicc, *COMPILE, "-o", tmp_name, str(SOURCE)], capture_output=True,
                                  text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"mpicc failed to run: {exc}"
        if proc.returncode != 0:
            return None, f"mpicc exited with status {proc.returncode}:\n{_tail(proc.stderr + proc.stdout)}"
        os.chmod(tmp_name, 0o755)
        os.replace(tmp_name, exe)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return exe, ""


def _open_mpi_version(mpirun: str, env: dict) -> tuple[str | None, str]:
    """('Open MPI x.y.z', "") or (None, why): run() passes Open MPI's options, which MPICH's or
    Intel MPI's mpirun would not take."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{mpirun} --version failed: {exc}"
    match = re.search(r"Open MPI\)?\s*([\d.]+\w*)", out.stdout + out.stderr)
    if not match:
        first = (out.stdout + out.stderr).strip().splitlines()[:1]
        return None, f"{mpirun} is not Open MPI's ({first[0] if first else 'no --version output'})"
    return f"Open MPI {match.group(1)}", ""


def single_copy_mechanism(env: dict | None = None) -> str:
    """vader's single-copy mechanism as ompi_info reports it ("cma", "xpmem", "knem", "none"), or
    "unknown" when ompi_info is missing or says nothing."""
    ompi_info = shutil.which("ompi_info")
    if ompi_info is None:
        return "unknown"
    try:
        out = subprocess.run([ompi_info, "--param", "btl", "vader", "--level", "9"], capture_output=True,
                             text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    match = re.search(r'btl_vader_single_copy_mechanism" \(current value: "([^"]*)"', out.stdout)
    return match.group(1) if match else "unknown"


def _spec(entries, fields: int, name: str) -> str:
    rows = [tuple(int(v) for v in entry) for entry in entries]
    for row in rows:
        if len(row) != fields or min(row) < 1:
            raise ValueError(f"{name} entries need {fields} positive integers, got {row}")
    return ",".join(":".join(str(v) for v in row) for row in rows)


def _mpirun(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str, str]:
    """(exit status or None on timeout, stdout, stderr). mpirun and its ranks run in their own
    session so that a timeout takes the ranks down with it."""
    before = _vader_segments()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err
    finally:
        # Ranks that were killed (or crashed) never unlink vader's shared-memory segments: the
        # ones that appeared during this run go (a benchmark run is meant to have the host to
        # itself; segments that existed before are left alone).
        if proc.returncode != 0:
            for path in _vader_segments() - before:
                path.unlink(missing_ok=True)


def _vader_segments() -> set[Path]:
    return set(Path("/dev/shm").glob("vader_segment.*"))


def run(exe: Path | str, stream: list[tuple[int, int, int]], latency: list[tuple[int, int]],
        timeout: float = 900) -> tuple[dict | None, str]:
    """Runs `exe` (from find_or_build) on two ranks over Open MPI's shared-memory path.

    stream: (size bytes, iters, window) entries; latency: (size bytes, iters) entries.
    Returns (result, "") with result the program's JSON --
      {"stream": [{"size", "iters", "window", "seconds_per_message"}...],
       "latency": [{"size", "iters", "one_way_seconds"}...], "mpi_version": str}
    -- plus "single_copy" (vader's large-message mechanism: "cma" = process_vm_readv, one copy;
    "none" = copy-in/copy-out through the shared segment), "mca" ({name: value} as passed),
    "command" (the argv), "wall_seconds" and "loadavg" (the 1-minute load average before the run,
    a hint: both ranks busy-poll, so any other busy process on a small machine spoils the
    numbers, and a load near the core count means they are suspect); or (None, why) when mpirun is missing, is not Open
    MPI's, timed out, or exited nonzero (with the tail of its stderr)."""
    stream_spec, latency_spec = _spec(stream, 3, "stream"), _spec(latency, 2, "latency")
    if not stream_spec and not latency_spec:
        raise ValueError("nothing to measure: give stream and/or latency entries")
    if not Path(exe).is_file():
        return None, f"{exe} does not exist (find_or_build() makes it)"
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None, "mpirun not found (install openmpi-bin)"
    env = dict(os.environ)  # the child's only: nothing is set in this process's environment
    env.setdefault("OMPI_MCA_btl_base_warn_component_unused", "0")  # no "unused component" notices
    version, why = _open_mpi_version(mpirun, env)
    if version is None:
        return None, why
    args = [mpirun, "-np", "2", "--bind-to", "none", "--oversubscribe"]
    if os.geteuid() == 0:
        args.append("--allow-run-as-root")
    program = [str(exe)]
    if stream_spec:
        program += ["--stream", stream_spec]
    if latency_spec:
        program += ["--latency", latency_spec]

    mca = dict(MCA)
    single_copy = mca.get("btl_vader_single_copy_mechanism") or single_copy_mechanism(env)
    note = ""
    load_before = os.getloadavg()[0]
    deadline = time.monotonic() + timeout
    while True:
        cmd = args + [item for name, value in mca.items() for item in ("--mca", name, value)] + program
        started = time.perf_counter()
        status, out, err = _mpirun(cmd, env, max(1.0, deadline - time.monotonic()))
        wall = time.perf_counter() - started
        if status is None:
            return None, f"mpirun timed out after {timeout:.0f} s (killed); stderr:\n{_tail(err)}"
        if status != 0 and single_copy != "none" and "btl_vader_single_copy_mechanism" not in mca \
                and _CMA_FAILURE.search(err):
            # The default single-copy mechanism is there but not usable here; measure without it.
            failure = _tail(err, 2).replace("\n", " | ")
            note = f"{single_copy} failed ({failure}); rerun with btl_vader_single_copy_mechanism none"
            mca["btl_vader_single_copy_mechanism"] = "none"
            single_copy = "none"
            continue
        break
    if status != 0:
        ours = [line for line in err.splitlines() if line.startswith("mpi_p2p:")]
        detail = "\n".join(ours) if ours else _tail(err)
        return None, f"mpirun exited with status {status}:\n{detail}"
    line = next((line for line in reversed(out.splitlines()) if line.startswith("{")), None)
    try:
        result = json.loads(line) if line else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        return None, f"no JSON line in mpi_p2p's output:\n{_tail(out)}\n{_tail(err)}"
    if single_copy == "cma" and _CMA_FALLBACK.search(err):
        note = f"cma not usable, vader fell back: {_tail(err, 3).replace(chr(10), ' | ')}"
        single_copy = "none"
    # Two busy-polling ranks need two idle cores: on a loaded machine the numbers are no reference.
    result.update(single_copy=single_copy, mca=mca, command=cmd, wall_seconds=wall, loadavg=load_before)
    if note:
        result["single_copy_note"] = note
    return result, ""


# shm_p2p.py's message sizes and iteration rules, for the command line below.
KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
LATENCY_SIZES = [8, 256, 4 * KIB]


def plan(budget_bytes: int = 1 << 30, latency_iters: int = 2000) -> tuple[list, list]:
    """(stream, latency) entries with shm_p2p.py's rules: ~budget bytes per size, 8..4000
    messages, window 16 up to 256 KiB else 4."""
    stream = [(s, max(8, min(4000, budget_bytes // s)), 16 if s <= 256 * KIB else 4) for s in SIZES]
    return stream, [(s, latency_iters) for s in LATENCY_SIZES]


def _human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else (f"{size // KIB} KiB" if size >= KIB else f"{size} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=int, default=1024, help="bytes streamed per size (default %(default)s)")
    parser.add_argument("--latency-iters", type=int, default=2000,
                        help="ping-pong round trips per latency size (default %(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where the executable is built (default {default_cache_dir()})")
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON instead of a table")
    args = parser.parse_args()

    exe, why = find_or_build(args.cache_dir)
    if exe is None:
        sys.exit(f"mpi_reference: {why}")
    stream, latency = plan(args.budget_mib * MIB, args.latency_iters)
    result, why = run(exe, stream, latency)
    if result is None:
        sys.exit(f"mpi_reference: {why}")
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['mpi_version']}; mca {result['mca']}; single_copy={result['single_copy']}; "
          f"{result['wall_seconds']:.1f} s")
    if "single_copy_note" in result:
        print(f"note: {result['single_copy_note']}")
    print(f"{'size':>8} {'iters':>6} {'window':>6} {'GB/s':>8}")
    for row in result["stream"]:
        print(f"{_human(row['size']):>8} {row['iters']:>6} {row['window']:>6} "
              f"{row['size'] / row['seconds_per_message'] / 1e9:>8.2f}")
    print(f"{'size':>8} {'one-way us':>10}")
    for row in result["latency"]:
        print(f"{_human(row['size']):>8} {row['one_way_seconds'] * 1e6:>10.2f}")


if __name__ == "__main__":
    main()
