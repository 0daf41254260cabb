"""The `fault` command line: its subcommands (see the package docstring) and what each does."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from megatron.scan.fault.cgroups import GROUP_PREFIX, CpuQuota, leftover_groups, release_group
from megatron.scan.fault.targets import (POLL_S, PROC, FaultError, RankProcess, alive, find_rank_processes, select,
                                        wait_for)


class _Stop:
    """Set by SIGINT / SIGTERM / SIGHUP, so that the hold loop undoes the fault and returns."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.reason = signal.Signals(signum).name
        self.event.set()

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _hold(processes: list[RankProcess], duration: float | None, stop: _Stop, tick=None) -> str:
    deadline = None if duration is None else time.monotonic() + duration
    while True:
        if stop.event.wait(POLL_S):
            return f"{stop.reason} received"
        if not alive(processes):
            return "the rank's processes ended"
        if deadline is not None and time.monotonic() >= deadline:
            return f"--for {duration:g} s elapsed"
        if tick is not None:
            tick()


def _describe(processes: list[RankProcess]) -> str:
    head = processes[0]
    who = f"rank {head.rank}" if head.rank >= 0 else f"pid {head.pid}"
    pids = ", ".join(str(p.pid) for p in processes)
    return f"{who} (pid {pids}{'' if head.job == '-' else f', job {head.job}'})"


def _target(args: argparse.Namespace) -> list[RankProcess]:
    return wait_for(args.rank, args.pid, args.job, args.wait)


def _delay(args: argparse.Namespace, stop: _Stop) -> bool:
    """Sleep `--after` seconds; False when interrupted first."""
    return not (args.after and stop.event.wait(args.after))


def cmd_throttle(args: argparse.Namespace) -> int:
    stop = _Stop()
    try:
        processes = _target(args)
        if not _delay(args, stop):
            print(f"[fault] {stop.reason} before the throttle was applied: nothing changed", flush=True)
            return 0
        quota = CpuQuota(args.cpu_fraction, processes)
        quota.apply()
        try:
            print(f"[fault] throttled {_describe(processes)}: {quota.moved} threads limited to "
                  f"{args.cpu_fraction:g} of one core (cgroup v{quota.version} {quota.group}); "
                  f"Ctrl-C releases", flush=True)
            why = _hold(processes, args.duration, stop, tick=quota.sweep_new_threads)
        finally:
            effect = quota.held_back()
            quota.release()
        print(f"[fault] released {_describe(processes)} ({why})" + (f"; {effect}" if effect else ""), flush=True)
        return 0
    finally:
        stop.restore()


def _signal_all(processes: list[RankProcess], sig: signal.Signals) -> int:
    sent = 0
    for p in processes:
        try:
            os.kill(p.pid, sig)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def _state(pid: int, proc: Path = PROC) -> str | None:
    try:
        return (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _wait_stopped(processes: list[RankProcess], timeout_s: float = 5.0, proc: Path = PROC) -> list[int]:
    """SIGSTOP takes effect when the kernel next schedules the process: wait until every live
    one shows state T, so "froze" is only said of stopped ranks. Returns the pids still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [p.pid for p in processes if _state(p.pid, proc) not in (None, "T", "t", "Z", "X")]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.01)


def cmd_freeze(args: argparse.Namespace) -> int:
    stop = _Stop()
    try:
        processes = _target(args)
        if not _delay(args, stop):
            return 0
        _signal_all(processes, signal.SIGSTOP)
        try:
            running = _wait_stopped(processes)
            if running:
                print(f"[fault] warning: pid {', '.join(map(str, running))} not stopped yet after 5 s", flush=True)
            print(f"[fault] froze {_describe(processes)} (SIGSTOP); Ctrl-C continues it", flush=True)
            why = _hold(processes, args.duration, stop)
        finally:
            _signal_all(processes, signal.SIGCONT)
        print(f"[fault] continued {_describe(processes)} ({why})", flush=True)
        return 0
    finally:
        stop.restore()


def cmd_thaw(args: argparse.Namespace) -> int:
    processes = select(args.rank, args.pid, args.job)
    _signal_all(processes, signal.SIGCONT)
    print(f"[fault] continued {_describe(processes)} (SIGCONT)", flush=True)
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    processes = select(args.rank, args.pid, args.job)
    sig = signal.Signals[f"SIG{args.signal.upper().removeprefix('SIG')}"]
    sent = _signal_all(processes, sig)
    print(f"[fault] sent {sig.name} to {_describe(processes)} ({sent} processes)", flush=True)
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    groups = leftover_groups()
    if args.rank is not None or args.pid is not None:
        pids = {str(p.pid) for p in select(args.rank, args.pid, args.job)}
        groups = [(g, v) for g, v in groups if g.name.removeprefix(GROUP_PREFIX) in pids]
    for group, version in groups:
        release_group(group, version)
        print(f"[fault] released {group}", flush=True)
    if not groups:
        print("[fault] no fault cgroup to release", flush=True)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    processes = find_rank_processes()
    if not processes:
        print("no process with a RANK in its environment on this host")
        return 0
    print(f"{'job':<40} {'rank':>4} {'local':>5} {'pid':>7} {'threads':>7}  command")
    for p in processes:
        print(f"{p.job:<40} {p.rank:>4} {'-' if p.local_rank is None else p.local_rank:>5} {p.pid:>7} "
              f"{len(p.threads()):>7}  {p.command[:60]}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The package's docstring (its parent package is always imported before this module).
    parser.description = sys.modules[__package__].__doc__.split("\n\n")[0]
    actions = parser.add_subparsers(dest="fault_action", required=True)

    def target(p: argparse.ArgumentParser, *, waits: bool) -> None:
        p.add_argument("--rank", type=int, default=None, help="global rank: the RANK in the worker's environment")
        p.add_argument("--pid", type=int, default=None, help="a process id instead of a rank (its children too)")
        p.add_argument("--job", default=None,
                       help="part of 'RUN_ID@MASTER_ADDR:MASTER_PORT' when several jobs on this host have the rank")
        if waits:
            p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                           help="wait up to SECONDS for the rank to appear (a job still starting)")
            p.add_argument("--after", type=float, default=0.0, metavar="SECONDS",
                           help="apply the fault SECONDS after the rank is found (a mid-run onset)")
            p.add_argument("--for", dest="duration", type=float, default=None, metavar="SECONDS",
                           help="undo the fault after SECONDS (default: hold until Ctrl-C or the rank ends)")

    p = actions.add_parser("throttle", help="limit every thread of a rank to a fraction of one core (cgroup quota)")
    target(p, waits=True)
    p.add_argument("--cpu-fraction", type=float, required=True, metavar="F",
                   help="CPU time allowed, as a share of one core per 100 ms period (0.25 = a quarter core)")
    p.set_defaults(handler=cmd_throttle)
    p = actions.add_parser("freeze", help="stop a rank (SIGSTOP) until Ctrl-C, --for, or the job ends")
    target(p, waits=True)
    p.set_defaults(handler=cmd_freeze)
    p = actions.add_parser("thaw", help="continue a stopped rank (SIGCONT)")
    target(p, waits=False)
    p.set_defaults(handler=cmd_thaw)
    p = actions.add_parser("kill", help="send a rank SIGKILL (or --signal)")
    target(p, waits=False)
    p.add_argument("--signal", default="KILL", help="signal name, e.g. TERM, INT, KILL (default)")
    p.set_defaults(handler=cmd_kill)
    p = actions.add_parser("release", help="undo throttles whose `fault throttle` was killed (all, or one rank's)")
    target(p, waits=False)
    p.set_defaults(handler=cmd_release)
    p = actions.add_parser("list", help="the ranks of the torchrun jobs on this host")
    p.set_defaults(handler=cmd_list)


def run(args: argparse.Namespace) -> int:
    try:
        return args.handler(args)
    except FaultError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PermissionError as exc:
        print(f"error: {exc}; faults on another user's processes need root", file=sys.stderr)
        return 2
