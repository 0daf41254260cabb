"""The ranks a fault acts on: the processes of a torchrun job on this host, found by the `RANK`
in their environment (or by PID), and the one error every fault command reports to the user."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

PROC = Path("/proc")
POLL_S = 0.2  # how often a waiting or holding fault looks at its target


class FaultError(RuntimeError):
    """The fault cannot be applied; the message says what to change."""


@dataclass(frozen=True, slots=True)
class RankProcess:
    pid: int
    rank: int
    local_rank: int | None
    job: str  # torchrun's run id and rendezvous endpoint: tells two jobs on one host apart
    command: str

    def threads(self, proc: Path = PROC) -> list[int]:
        try:
            return sorted(int(t) for t in os.listdir(proc / str(self.pid) / "task"))
        except FileNotFoundError:
            return []


def _environ(pid_dir: Path) -> dict[str, str]:
    try:
        raw = (pid_dir / "environ").read_bytes()
    except (FileNotFoundError, PermissionError, ProcessLookupError, OSError):
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _command(pid_dir: Path) -> str:
    try:
        return (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def find_rank_processes(proc: Path = PROC) -> list[RankProcess]:
    """Every process on this host with a RANK in its environment (torchrun workers and their
    children, e.g. data-loader workers), this one excluded."""
    found = []
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        env = _environ(entry)
        if "RANK" not in env or not env["RANK"].isdigit():
            continue
        job = "{}@{}:{}".format(env.get("TORCHELASTIC_RUN_ID", "-"), env.get("MASTER_ADDR", "-"),
                                env.get("MASTER_PORT", "-"))
        local = env.get("LOCAL_RANK")
        found.append(RankProcess(pid=int(entry.name), rank=int(env["RANK"]),
                                 local_rank=int(local) if local and local.isdigit() else None, job=job,
                                 command=_command(entry)))
    return sorted(found, key=lambda p: (p.job, p.rank, p.pid))


def _descendants(root: int, proc: Path) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    result, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in result:
                result.add(child)
                todo.append(child)
    return result


def select(rank: int | None, pid: int | None, job: str | None, proc: Path = PROC) -> list[RankProcess]:
    """The processes of one rank of one job (or one PID and its children); a clear error when
    none or several jobs match."""
    if pid is not None:
        if not (proc / str(pid)).exists():
            raise FaultError(f"no process {pid} on this host")
        family = _descendants(pid, proc)
        matched = [p for p in find_rank_processes(proc) if p.pid in family]
        own = [p for p in matched if p.pid == pid]
        if not own:  # a PID outside torchrun: take it as it is
            own = [RankProcess(pid=pid, rank=-1, local_rank=None, job="-", command=_command(proc / str(pid)))]
        return own + [p for p in matched if p.pid != pid]
    if rank is None:
        raise FaultError("name the target: --rank R (the RANK of a torchrun worker) or --pid PID")
    candidates = [p for p in find_rank_processes(proc) if p.rank == rank and (job is None or job in p.job)]
    if not candidates:
        known = sorted({p.rank for p in find_rank_processes(proc)})
        raise FaultError(f"no process with RANK={rank}{f' in job {job!r}' if job else ''} on this host "
                         f"(ranks here: {known or 'none'}); `python -m megatron.scan fault list` shows them")
    jobs = sorted({p.job for p in candidates})
    if len(jobs) > 1:
        raise FaultError(f"RANK={rank} exists in {len(jobs)} jobs on this host ({', '.join(jobs)}): "
                         f"pass --job with part of one of these, or --pid")
    return candidates


def wait_for(rank: int | None, pid: int | None, job: str | None, timeout_s: float,
             proc: Path = PROC) -> list[RankProcess]:
    """`select`, retried until the rank appears (a job that is still starting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return select(rank, pid, job, proc)
        except FaultError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(POLL_S)


def alive(processes: Iterable[RankProcess], proc: Path = PROC) -> bool:
    for p in processes:
        try:
            state = (proc / str(p.pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            return True
    return False
