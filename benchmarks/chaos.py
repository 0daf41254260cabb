"""Fault campaign: real 4-rank training jobs under `torchrun --max-restarts 3`, faults injected from
OUTSIDE the processes (signals, a full disk, a reset TCP connection), then recovery is checked.

    python benchmarks/chaos.py --faults 50 [--seed S] [--keep DIR]

Job kinds (PP=2 x DP=2, tiny GPT, mock data, --deterministic-mode, --save/--load on one checkpoint
directory, --save-interval 4, 24 iterations): `pp2dp2`, `pp2dp2-trace` (`--trace --trace-dir`),
`dpp` (`--use-dpp`, shm_tensor_rdma transport). One clean run per kind gives the reference losses.

Faults (kind and job drawn from a seeded, shuffled deck of every combination, so that a short
campaign covers every cell):
  sigkill          SIGKILL of a random rank at a random moment of a random iteration
  sigkill-in-save  SIGKILL of a random rank while the iter_N.tmp staging directory of a save exists
  sigstop          SIGSTOP of a random rank for 2-6 s, then SIGCONT
  disk-full        --save on a tmpfs sized so that a later save does not fit; after the job stops the
                   campaign remounts the tmpfs bigger (an operator freeing space) and reruns the command
  net-reset        one established TCP connection between two ranks' processes destroyed with
                   `ss -K` (the kernel aborts the socket and sends the peer a RST)

Checks per fault: the job finishes (through restarts, and for disk-full the operator's rerun) with
exit 0; every logged loss of every attempt equals the clean run's at that iteration (exact strings),
so the final one does too; the tracker names the last iteration and that checkpoint loads (manifest
sha256 when present, torch.load, its iteration); traces parse (read_rank_file, scripts/aggregate.py);
nothing left behind (the job's processes, their listening ports, new /dev/shm entries, fault cgroups,
tmpfs mounts). Exit status is 0 whatever happened; the table is the result.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# tests/app/conftest.py's SMALL_MODEL (not imported: that module needs pytest).
SMALL_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "2e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--log-interval", "1", "--device", "cpu",
]
ITERS = 24
SAVE_INTERVAL = 4
NPROC = 4
MAX_RESTARTS = 3
JOB_TIMEOUT_S = 300.0
JOB_KINDS = ("pp2dp2", "pp2dp2-trace", "dpp")
FAULT_KINDS = ("sigkill", "sigkill-in-save", "sigstop", "disk-full", "net-reset")
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|")
LOADED = re.compile(r"loaded checkpoint from \S+ at iteration (\d+)")
ATTEMPT = re.compile(r"^training: \d+ iterations", re.M)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_args(kind: str, run: Path, ckpt: Path) -> list[str]:
    args = [*SMALL_MODEL, "--mock-data", "--vocab-size", "256", "--train-iters", str(ITERS),
            "--pipeline-model-parallel-size", "2", "--save", str(ckpt), "--load", str(ckpt),
            "--save-interval", str(SAVE_INTERVAL), "--deterministic-mode"]
    if kind == "pp2dp2-trace":
        args += ["--trace", "--trace-dir", str(run / "trace")]
    elif kind == "dpp":
        args += ["--use-dpp"]
    return args


# --- processes ---------------------------------------------------------------------------------------

def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def tagged_processes(tag: str) -> list[int]:
    """Every live process carrying CHAOS_JOB=tag in its environment (the launcher, the agent, the
    workers and anything they started; torchrun puts workers in their own sessions)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            if _environ(int(entry.name)).get("CHAOS_JOB") == tag:
                state = _state(int(entry.name))
                if state and state != "Z":
                    found.append(int(entry.name))
    return found


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def worker_pids(tag: str) -> dict[int, int]:
    """{global rank: pid} of the current attempt's workers (the process whose parent is not itself
    a worker of the same rank)."""
    ranks: dict[int, list[int]] = {}
    for pid in tagged_processes(tag):
        env = _environ(pid)
        if "LOCAL_RANK" in env and "RANK" in env and "TORCHELASTIC_RESTART_COUNT" in env:
            ranks.setdefault(int(env["RANK"]), []).append(pid)
    result = {}
    for rank, pids in ranks.items():
        roots = [p for p in pids if _ppid(p) not in pids]
        result[rank] = min(roots or pids)
    return result


def signal_pid(pid: int, sig: int) -> bool:
    if pid <= 1:  # never a process group or every process
        raise ValueError(f"refusing to signal pid {pid}")
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


# --- TCP connections between ranks (ss) ---------------------------------------------------------------

_SS_USER = re.compile(r"pid=(\d+)")


def _split_address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host.strip("[]"), int(port)


def established(pids: set[int]) -> list[tuple[int, tuple[str, int], tuple[str, int]]]:
    """(owner pid, local, peer) of every established TCP socket owned by one of `pids`."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        owners = {int(p) for p in _SS_USER.findall(line)} & pids
        for owner in owners:
            rows.append((owner, _split_address(fields[2]), _split_address(fields[3])))
    return rows


def reset_connection(local: tuple[str, int], peer: tuple[str, int]) -> str:
    """Destroys one socket (`ss -K`, needs CONFIG_INET_DIAG_DESTROY): the kernel aborts it and sends
    the peer a RST. Returns ss's output (the sockets it killed)."""
    expr = f"( sport = :{local[1]} and dport = :{peer[1]} )"
    done = subprocess.run(["ss", "-K", "-tnH", "state", "established", expr], capture_output=True, text=True)
    return (done.stdout + done.stderr).strip()


# --- environment snapshots ---------------------------------------------------------------------------

def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def fault_cgroups() -> set[str]:
    try:
        from megatron.scan.fault.cgroups import leftover_groups
        return {str(group) for group, _ in leftover_groups()}
    except Exception:  # noqa: BLE001 - an unreadable hierarchy is not the job's leftover
        return set()


def mounts_under(root: Path) -> list[str]:
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and (fields[1] == str(root) or fields[1].startswith(str(root) + "/")):
            found.append(f"{fields[2]} {fields[1]}")
    return found


def listening_ports(pids: set[int]) -> list[int]:
    out = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True).stdout
    return [_split_address(line.split()[3])[1] for line in out.splitlines()
            if {int(p) for p in _SS_USER.findall(line)} & pids and len(line.split()) > 3]


def port_listening(port: int) -> bool:
    out = subprocess.run(["ss", "-tlnH", f"( sport = :{port} )"], capture_output=True, text=True).stdout
    return bool(out.strip())


# --- one job -----------------------------------------------------------------------------------------

class Job:
    """One torchrun command; `start()` may be called again (the operator's rerun) with the same
    command, its output going to the next out.N / err.N files."""

    def __init__(self, run: Path, kind: str, ckpt: Path, tag: str) -> None:
        self.run, self.kind, self.ckpt, self.tag = run, kind, ckpt, tag
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.outputs: list[Path] = []
        self.started = 0.0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC),
                "--master-addr", "127.0.0.1", "--master-port", str(self.port),
                "--max-restarts", str(MAX_RESTARTS), "--monitor-interval", "1",
                "pretrain_gpt.py", *job_args(self.kind, self.run, self.ckpt)]

    def start(self) -> None:
        n = len(self.outputs)
        if port_listening(self.port):  # an operator's rerun on a busy port: the same command elsewhere
            self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CHAOS_JOB=self.tag)
        out = self.run / f"out.{n}.txt"
        self.outputs.append(out)
        with open(out, "w") as stdout, open(self.run / f"err.{n}.txt", "w") as stderr:
            self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=env, stdout=stdout, stderr=stderr,
                                         start_new_session=True)
        self.started = time.monotonic()

    def text(self, index: int = -1) -> str:
        try:
            return self.outputs[index].read_text(errors="replace")
        except OSError:
            return ""

    def stderr(self, index: int = -1) -> str:
        try:
            return (self.run / f"err.{len(self.outputs) - 1 if index == -1 else index}.txt").read_text(errors="replace")
        except OSError:
            return ""

    def last_iteration(self) -> int:
        found = LOSS_LINE.findall(self.text())
        return int(found[-1][0]) if found else 0

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> int | None:
        """Exit status, or None if it ran past `timeout` (then every process of the job is killed)."""
        left = timeout - (time.monotonic() - self.started)
        try:
            return self.proc.wait(timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            self.kill_all()
            self.proc.wait()
            return None

    def kill_all(self) -> None:
        for pid in tagged_processes(self.tag):
            signal_pid(pid, signal.SIGKILL)

    def wait_until(self, predicate, timeout: float = 120.0, poll: float = 0.005) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            if not self.running():
                return bool(predicate())
            time.sleep(poll)
        return False


# --- checks ------------------------------------------------------------------------------------------

def logged_losses(text: str) -> list[tuple[int, str]]:
    return [(int(i), loss) for i, loss in LOSS_LINE.findall(text)]


def check_checkpoint(ckpt: Path) -> list[str]:
    """Problems with the newest checkpoint: the tracker must name ITERS, the manifest (when there is
    one) must match every file, and every rank file must load and hold that iteration."""
    import torch

    tracker = ckpt / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return [f"no tracker in {ckpt}"]
    text = tracker.read_text().strip()
    if text != str(ITERS):
        return [f"tracker says {text!r}, expected {ITERS}"]
    directory = ckpt / f"iter_{ITERS:07d}"
    problems = []
    files = sorted(directory.glob("mp_rank_*/model_optim_rng.pt"))
    if len(files) != 2:
        problems.append(f"{directory}: {len(files)} rank files, expected 2")
    manifest = directory / "manifest.json"
    if manifest.is_file():
        entries = json.loads(manifest.read_text()).get("files", {})
        for name, entry in entries.items():
            path = directory / name
            digest = entry.get("sha256") if isinstance(entry, dict) else None
            if not path.is_file():
                problems.append(f"manifest names missing {name}")
            elif digest and hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                problems.append(f"{name}: sha256 differs from the manifest")
    for path in files:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
            if payload.get("iteration") != ITERS:
                problems.append(f"{path.relative_to(ckpt)} holds iteration {payload.get('iteration')}")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{path.relative_to(ckpt)} does not load: {type(exc).__name__}: {exc}")
    return problems


def check_trace(trace: Path, notes: list[str]) -> list[str]:
    """Every trace file parses; every run in the directory aggregates (a torchrun restart continues
    its run in -attemptN files; an operator's rerun of the command is a new run)."""
    from megatron.scan.trace_format import iter_trace_files, read_rank_file

    files = iter_trace_files(trace)
    problems, runs = [], {}
    for path in files:
        try:
            rank_file = read_rank_file(path)
            runs.setdefault(rank_file.header.get("run_id"), []).append(path.name)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{path.name}: {type(exc).__name__}: {exc}")
    if not files:
        problems.append(f"no trace files in {trace}")
    if len(runs) > 1:
        notes.append(f"trace dir holds {len(runs)} runs: " + "; ".join(
            f"{run}: {len(names)} files" for run, names in runs.items()))
    for run in runs:
        done = subprocess.run([sys.executable, "scripts/aggregate.py", "-b", str(trace), "-o",
                               str(trace.parent / f"merged_{run}.json"), "--run-id", str(run)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            problems.append(f"scripts/aggregate.py -b {trace} --run-id {run} exit {done.returncode}: "
                            f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return problems


# --- faults ------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    index: int
    fault: str
    kind: str
    action: str = ""
    rc: int | None = None
    attempts: int = 0
    loaded: list[int] = field(default_factory=list)
    finished: bool = False
    mismatches: list[str] = field(default_factory=list)
    checkpoint: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def lost(self) -> bool:
        return bool((self.finished and (self.mismatches or self.checkpoint or self.trace)) or self.leftovers)

    @property
    def survived(self) -> bool:
        return self.finished and not self.lost


def inject(job: Job, out: Outcome, rng: random.Random) -> None:
    """Runs while the job's first command runs: waits for the moment, then injects the fault."""
    if out.fault in ("sigkill", "sigstop", "net-reset"):
        at = rng.randint(2, ITERS - 2)
        if not job.wait_until(lambda: job.last_iteration() >= at):
            out.action = f"job ended before iteration {at}"
            return
        time.sleep(rng.uniform(0.0, 0.08))
        workers = worker_pids(job.tag)
        if len(workers) < NPROC:
            out.action = f"only ranks {sorted(workers)} alive at iteration {at}"
            return
        if out.fault == "sigkill":
            rank = rng.randrange(NPROC)
            signal_pid(workers[rank], signal.SIGKILL)
            out.action = f"SIGKILL rank {rank} after iteration {job.last_iteration()}"
        elif out.fault == "sigstop":
            rank, seconds = rng.randrange(NPROC), rng.uniform(2.0, 6.0)
            signal_pid(workers[rank], signal.SIGSTOP)
            stopped_at = job.last_iteration()
            time.sleep(seconds)
            signal_pid(workers[rank], signal.SIGCONT)
            out.action = (f"SIGSTOP rank {rank} after iteration {stopped_at} for {seconds:.1f}s "
                          f"(iteration {job.last_iteration()} logged at SIGCONT)")
        else:
            a, b = rng.sample(range(NPROC), 2)
            rows = [(local, peer) for owner, local, peer in established({workers[a]})
                    if any(o == workers[b] and l2 == peer and p2 == local
                           for o, l2, p2 in established({workers[b]}))]
            if not rows:
                out.action = f"no established TCP connection between ranks {a} and {b}"
                return
            local, peer = rng.choice(rows)
            killed = reset_connection(local, peer)
            out.action = (f"ss -K rank {a} {local[1]} <-> rank {b} {peer[1]} "
                          f"({len(rows)} connections between them) after iteration {job.last_iteration()}"
                          + ("" if killed else " [ss -K killed nothing]"))
    elif out.fault == "sigkill-in-save":
        save = rng.choice(range(SAVE_INTERVAL, ITERS + 1, SAVE_INTERVAL))
        staging = job.ckpt / f"iter_{save:07d}.tmp"
        if not job.wait_until(lambda: job.last_iteration() >= save - 1):
            out.action = f"job ended before iteration {save - 1}"
            return
        workers = worker_pids(job.tag)
        if not job.wait_until(staging.exists, timeout=30.0, poll=0.0005):
            out.action = f"never saw {staging.name}"
            return
        rank = rng.randrange(NPROC)
        if rank not in workers:
            out.action = f"rank {rank} not alive at the save of iteration {save}"
            return
        signal_pid(workers[rank], signal.SIGKILL)
        out.action = (f"SIGKILL rank {rank} during the save of iteration {save} "
                      f"(staging {'still there' if staging.exists() else 'gone'} right after the kill)")


def run_fault(index: int, fault: str, kind: str, root: Path, rng: random.Random, clean: dict,
              ckpt_bytes: int) -> Outcome:
    out = Outcome(index, fault, kind)
    run = root / f"fault-{index:03d}-{fault}-{kind}"
    run.mkdir(parents=True)
    ckpt = run / "ckpt"
    ckpt.mkdir()
    job = Job(run, kind, ckpt, tag=f"{os.getpid()}-{index}")
    shm_before, cgroups_before = shm_entries(), fault_cgroups()
    began = time.monotonic()
    mounted = False
    try:
        if fault == "disk-full":
            fits = rng.randint(1, ITERS // SAVE_INTERVAL - 2)
            size = (fits * ckpt_bytes + ckpt_bytes // 2 + 4095) // 4096 * 4096
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "chaos", str(ckpt)], check=True)
            mounted = True
            out.action = (f"--save on a {size / 2**20:.1f} MiB tmpfs ({fits} checkpoints of "
                          f"{ckpt_bytes / 2**20:.2f} MiB fit)")
        job.start()
        if fault != "disk-full":
            inject(job, out, rng)
        out.rc = job.wait()
        if fault == "disk-full":
            first = job.text(0) + job.stderr(0)
            full = bool(re.search(r"No space left|ENOSPC|disk.{0,10}full", first, re.I))
            if out.rc == 0:
                out.notes.append("the first command finished: no save failed")
            else:
                tracker = ckpt / "latest_checkpointed_iteration.txt"
                before = tracker.read_text().strip() if tracker.is_file() else "none"
                staging = sorted(p.name for p in ckpt.glob("iter_*.tmp"))
                out.notes.append(f"first command exit {out.rc} ({'disk full reported' if full else 'NO disk-full message'}"
                                 f", tracker {before}, staging left {staging or 'none'}); remounted 256 MiB, reran")
                subprocess.run(["mount", "-o", "remount,size=256m", str(ckpt)], check=True)
                job.start()
                out.rc = job.wait()
                if LOADED.search(job.text()) is None:
                    out.notes.append("the rerun loaded no checkpoint")
                elif before != "none" and int(LOADED.search(job.text()).group(1)) != int(before):
                    out.notes.append(f"the rerun loaded {LOADED.search(job.text()).group(1)}, not {before}")
        texts = [job.text(i) for i in range(len(job.outputs))]
        out.attempts = sum(len(ATTEMPT.findall(t)) for t in texts)
        out.loaded = [int(m) for t in texts for m in LOADED.findall(t)]
        if out.rc is None:
            out.notes.append(f"hung: killed after {JOB_TIMEOUT_S:.0f}s")
        out.finished = out.rc == 0
        reference = clean[kind]
        for i, loss in itertools.chain.from_iterable(logged_losses(t) for t in texts):
            if reference.get(i) != loss:
                out.mismatches.append(f"iteration {i}: {loss} != clean {reference.get(i)}")
        final = logged_losses(texts[-1])
        if out.finished and (not final or final[-1] != (ITERS, reference[ITERS])):
            out.mismatches.append(f"final logged {final[-1] if final else None}, clean {(ITERS, reference[ITERS])}")
        if out.finished:
            out.checkpoint = check_checkpoint(ckpt)
            if kind == "pp2dp2-trace":
                out.trace = check_trace(run / "trace", out.notes)
    finally:
        # Leftovers: give the job's processes a moment to exit, then look.
        deadline = time.monotonic() + 10
        while tagged_processes(job.tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = set(tagged_processes(job.tag))
        if alive:
            ports = listening_ports(alive)
            out.leftovers.append(f"processes {sorted(alive)}" + (f" listening on {ports}" if ports else ""))
            job.kill_all()
        if job.outputs and port_listening(job.port):
            out.leftovers.append(f"master port {job.port} still listening")
        new_shm = shm_entries() - shm_before
        if new_shm:
            out.leftovers.append(f"/dev/shm: {sorted(new_shm)}")
        new_groups = fault_cgroups() - cgroups_before
        if new_groups:
            out.leftovers.append(f"cgroups: {sorted(new_groups)}")
        if mounted:
            subprocess.run(["umount", str(ckpt)], capture_output=True)
        left = mounts_under(run)
        if left:
            out.leftovers.append(f"mounts: {left}")
            for line in left:
                subprocess.run(["umount", "-l", line.split()[1]], capture_output=True)
        out.seconds = time.monotonic() - began
    return out


# --- campaign ----------------------------------------------------------------------------------------

def clean_run(kind: str, root: Path) -> tuple[dict[int, str], int]:
    run = root / f"clean-{kind}"
    run.mkdir(parents=True)
    job = Job(run, kind, run / "ckpt", tag=f"{os.getpid()}-clean-{kind}")
    job.start()
    rc = job.wait()
    losses = dict(logged_losses(job.text()))
    if rc != 0 or sorted(losses) != list(range(1, ITERS + 1)):
        tail = (job.text()[-1500:] + job.stderr()[-2500:])
        raise SystemExit(f"clean {kind} run failed (exit {rc}):\n{tail}\n{shlex.join(job.command())}")
    size = sum(f.stat().st_size for f in (run / "ckpt" / f"iter_{ITERS:07d}").rglob("*") if f.is_file())
    return losses, size


def describe(out: Outcome) -> str:
    if out.survived:
        verdict = "survived"
    elif out.lost:
        verdict = "LOST DATA"
    else:
        verdict = "not survived" if out.rc is not None else "HUNG"
    extra = []
    restarts = max(out.attempts - 1, 0)
    extra.append(f"attempts {out.attempts} ({restarts} restarts)" + (f", loaded {out.loaded}" if out.loaded else ""))
    extra.append(f"exit {out.rc}")
    for label, items in (("loss", out.mismatches), ("ckpt", out.checkpoint), ("trace", out.trace),
                         ("leftovers", out.leftovers)):
        if items:
            extra.append(f"{label}: {'; '.join(items[:3])}" + (f" (+{len(items) - 3})" if len(items) > 3 else ""))
    extra += out.notes
    return f"{out.action} -> {', '.join(extra)} | {verdict} ({out.seconds:.0f}s)"


def table(outcomes: list[Outcome]) -> str:
    width = 18
    lines = ["tried / survived / lost data", f"{'fault':<16}" + "".join(f"{k:>{width}}" for k in JOB_KINDS)
             + f"{'all':>{width}}"]
    for fault in FAULT_KINDS:
        cells = []
        for kind in (*JOB_KINDS, None):
            rows = [o for o in outcomes if o.fault == fault and (kind is None or o.kind == kind)]
            cells.append(f"{len(rows)} / {sum(o.survived for o in rows)} / {sum(o.lost for o in rows)}")
        lines.append(f"{fault:<16}" + "".join(f"{c:>{width}}" for c in cells))
    cells = []
    for kind in (*JOB_KINDS, None):
        rows = [o for o in outcomes if kind is None or o.kind == kind]
        cells.append(f"{len(rows)} / {sum(o.survived for o in rows)} / {sum(o.lost for o in rows)}")
    lines.append(f"{'all':<16}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=50, help="number of faulty jobs (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the draw of faults, job kinds, ranks and moments (default 0)")
    parser.add_argument("--keep", default=None, metavar="DIR", help="copy the run directory (logs, checkpoints, "
                        "traces) of every fault that was not survived into DIR")
    parser.add_argument("--only", default=None, help="comma-separated fault kinds to draw from (default: all)")
    parser.add_argument("--jobs", default=None, help="comma-separated job kinds to draw from (default: all)")
    args = parser.parse_args()
    faults = args.only.split(",") if args.only else list(FAULT_KINDS)
    kinds = args.jobs.split(",") if args.jobs else list(JOB_KINDS)
    for name in (*faults, *kinds):
        if name not in (*FAULT_KINDS, *JOB_KINDS):
            parser.error(f"unknown kind {name!r}")
    command = "python benchmarks/chaos.py " + shlex.join(sys.argv[1:])
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="chaos-"))
    outcomes: list[Outcome] = []
    began = time.monotonic()
    try:
        clean, sizes = {}, {}
        for kind in kinds:
            t0 = time.monotonic()
            clean[kind], sizes[kind] = clean_run(kind, root)
            print(f"clean {kind}: final loss {clean[kind][ITERS]}, checkpoint {sizes[kind] / 2**20:.2f} MiB "
                  f"({time.monotonic() - t0:.0f}s)", flush=True)
        deck: list[tuple[str, str]] = []
        while len(deck) < args.faults:
            combos = [(f, k) for f in faults for k in kinds]
            rng.shuffle(combos)
            deck += combos
        for index, (fault, kind) in enumerate(deck[:args.faults], 1):
            out = run_fault(index, fault, kind, root, rng, clean, sizes[kind])
            outcomes.append(out)
            print(f"[{index:>3}/{args.faults}] {fault:<15} {kind:<13} {describe(out)}", flush=True)
            run = root / f"fault-{index:03d}-{fault}-{kind}"
            if args.keep and not out.survived:
                shutil.copytree(run, Path(args.keep) / run.name, dirs_exist_ok=True)
            shutil.rmtree(run, ignore_errors=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    finally:
        for line in mounts_under(root):
            subprocess.run(["umount", "-l", line.split()[1]], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(outcomes))
    stops = [o for o in outcomes if o.fault == "sigstop" and o.finished]
    if stops:
        print(f"sigstop: {sum(o.attempts == 1 for o in stops)} of {len(stops)} finished jobs went on without a "
              f"restart, {sum(o.attempts > 1 for o in stops)} restarted")
    resets = [o for o in outcomes if o.fault == "net-reset" and o.finished]
    if resets:
        print(f"net-reset: {sum(o.attempts == 1 for o in resets)} of {len(resets)} finished jobs went on without a "
              f"restart, {sum(o.attempts > 1 for o in resets)} restarted")
    print(f"{len(outcomes)} faults in {(time.monotonic() - began) / 60:.1f} min; command: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
