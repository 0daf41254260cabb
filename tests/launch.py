"""Helpers for multi-rank tests: run real torchrun/gloo jobs with a hard timeout."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env() -> dict[str, str]:
    result = dict(os.environ)
    result["PYTHONPATH"] = str(ROOT) + os.pathsep + result.get("PYTHONPATH", "")
    result["PYTHONWARNINGS"] = "ignore"
    result["OMP_NUM_THREADS"] = "1"
    result.setdefault("PYTHONUNBUFFERED", "1")
    return result


def torchrun(script: str | Path, args: list[str], nproc: int, timeout: float = 240,
             extra_env: dict | None = None, torchrun_args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Launch `torchrun --nproc-per-node nproc script args`; output is captured as text."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        *(torchrun_args or []), str(script), *args,
    ]
    run_env = env()
    run_env.update(extra_env or {})
    return subprocess.run(command, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)


def python(args: list[str], timeout: float = 240, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    run_env = env()
    run_env.update(extra_env or {})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=run_env, capture_output=True, text=True,
                          timeout=timeout)


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (torchrun puts its workers in their own sessions, so a
    process-group kill does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it at once, as a node failure would."""
    import signal

    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_nodes(commands: list[list[str]], timeout: float = 240) -> list[tuple[int, str]]:
    """Start every command at once (the nodes of one job, e.g. `torchrun --nnodes 2` launches) and
    wait for all; (return code, output) per command. Whatever is left is killed with its children."""
    jobs = [subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for command in commands]
    try:
        outputs = [job.communicate(timeout=timeout)[0] for job in jobs]
    finally:
        for job in jobs:
            kill_tree(job.pid)
    return [(job.returncode, output) for job, output in zip(jobs, outputs)]


def writable_hierarchy() -> tuple[int, Path] | None:
    """(cgroup version, hierarchy) that `fault throttle` would use on this host, or None."""
    from megatron.scan.fault import cgroups, targets

    try:
        quota = cgroups.CpuQuota(1.0, [])
    except targets.FaultError:
        return None
    return quota.version, quota.hierarchy
