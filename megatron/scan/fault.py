"""`python -m megatron.scan fault ...`: faults applied from outside a running job, for validating
slow-rank detection the way real slowness arrives (nothing in the process knows). A rank is found
by the `RANK` in its workers' environment (or by PID); the job never cooperates.

    throttle --rank R --cpu-fraction F   cgroup CPU quota on every thread of rank R (v1 or v2)
    freeze --rank R / thaw --rank R      SIGSTOP / SIGCONT
    kill --rank R [--signal S]           SIGKILL (or S)
    release [--rank R]                   undo what a killed `throttle` left behind
    list                                 the ranks of the jobs on this host

`throttle` and `freeze` hold until Ctrl-C (or SIGTERM), `--for SECONDS`, or the rank's processes
are gone, then undo what they did: threads back in their own cgroup, the fault group removed, a
frozen rank continued."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

GROUP_PREFIX = "megascan-fault-"
PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
POLL_S = 0.2
# cgroup v2 may put the quota group above the rank's own cgroup; where each process came from is
# kept here too, so that `release` after a killed `throttle` sends it back there, not to the group's parent.
STATE_DIR = Path(os.environ.get("MEGASCAN_FAULT_STATE_DIR", "/run/megascan-fault"))


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


# ---------------------------------------------------------------------------------------- cgroups


class CpuQuota:
    """A child cgroup holding the target's threads under a CPU quota, created in their own cgroup
    (v1, and v2 where that cgroup can pass the cpu controller on; otherwise under the nearest
    ancestor that can, see `_v2_parent`). `release` puts everything back where it was."""

    def __init__(self, fraction: float, processes: Sequence[RankProcess], *, root: Path = CGROUP_ROOT,
                 proc: Path = PROC) -> None:
        if fraction <= 0:
            raise FaultError(f"--cpu-fraction must be > 0 (share of one core), got {fraction}")
        self.fraction = fraction
        self.processes = list(processes)
        self.root = root
        self.proc = proc
        self.version, self.hierarchy = self._hierarchy()
        self.group: Path | None = None
        self.moved = 0
        self.origins: dict[int, Path] = {}  # v2: each moved process's own cgroup, to go back to
        self.enabled: Path | None = None  # v2: where this fault turned the cpu controller on, to turn off

    def _hierarchy(self) -> tuple[int, Path]:
        v1 = self.root / "cpu"
        if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
            return 1, v1
        if (self.root / "cgroup.controllers").exists() and os.access(self.root, os.W_OK):
            if "cpu" not in (self.root / "cgroup.controllers").read_text().split():
                raise FaultError(f"cgroup v2 at {self.root} has no cpu controller; throttling needs it")
            return 2, self.root
        raise FaultError(f"no writable CPU cgroup: neither {v1}/cpu.cfs_quota_us (v1) nor {self.root}/cpu.max (v2) "
                         f"can be written; run as root on a host whose cgroups are mounted read-write")

    def _current(self, pid: int) -> Path:
        """The target's own cgroup directory in this hierarchy."""
        for line in (self.proc / str(pid) / "cgroup").read_text().splitlines():
            number, controllers, path = line.split(":", 2)
            if (self.version == 1 and "cpu" in controllers.split(",")) or (self.version == 2 and number == "0"):
                return self.hierarchy / path.lstrip("/")
        raise FaultError(f"process {pid} is in no {'cpu' if self.version == 1 else 'v2'} cgroup")

    def apply(self) -> None:
        first = self.processes[0].pid
        own = self._current(first)
        parent = own if self.version == 1 else self._v2_parent(own)
        self.group = parent / f"{GROUP_PREFIX}{first}"
        try:
            self.group.mkdir(exist_ok=True)
            if self.version == 1:
                period = int((self.group / "cpu.cfs_period_us").read_text())
                _write(self.group / "cpu.cfs_quota_us", str(max(1000, int(self.fraction * period))))
                for p in self.processes:
                    for tid in p.threads(self.proc):
                        self.moved += _move(self.group / "tasks", tid)
            else:
                period = 100_000
                _write(self.group / "cpu.max", f"{max(1000, int(self.fraction * period))} {period}")
                for p in self.processes:
                    try:
                        self.origins[p.pid] = self._current(p.pid)
                    except OSError:  # exited meanwhile
                        continue
                _save_state(self.group, self.origins, self.enabled)  # before any move: a kill loses nothing
                for pid in self.origins:  # v2 moves whole processes (all their threads)
                    process = next(p for p in self.processes if p.pid == pid)
                    self.moved += len(process.threads(self.proc)) if _move(self.group / "cgroup.procs", pid) else 0
        except OSError as exc:
            group = self.group
            self.release()
            raise FaultError(f"cgroup v{self.version}: could not set up the quota group {group}: {exc}") from exc
        except BaseException:
            self.release()
            raise
        if not self.moved:
            self.release()
            raise FaultError("the target exited before it could be throttled")

    def _v2_parent(self, own: Path) -> Path:
        """Where the v2 quota group can live: the nearest of the target's own cgroup and its
        ancestors that holds no process (the no-internal-process rule; the hierarchy's root is
        exempt) and passes the cpu controller to its children, or can be made to. Turning cpu on
        in a cgroup that holds processes would make it a thread root, a change that outlives the
        fault and leaves its children unable to take a process (EOPNOTSUPP): such a level is
        skipped. A container's or a service manager's cgroup (a job in `/process_api/<id>` on a
        VM) holds processes, so the group goes to a level above it, and the rank is moved there
        for the fault's duration; `release` puts every process back and turns off what it turned
        on, once no other fault group under that level needs it."""
        candidates = [own, *[a for a in own.parents if a == self.hierarchy or self.hierarchy in a.parents]]
        tried = []
        for directory in candidates:
            if directory != self.hierarchy and _read_ids(directory / "cgroup.procs"):
                tried.append(f"{directory} (holds processes)")
                continue
            enabled = _enable_cpu(directory)
            if enabled is not None:
                self.enabled = directory if enabled or _enabled_by_a_fault(directory) else None
                return directory
            tried.append(str(directory))
        raise FaultError(f"cgroup v2: the cpu controller cannot be enabled for the children of {', '.join(tried)}; "
                         f"enable it from the root down (echo +cpu > <dir>/cgroup.subtree_control at every level)")

    def sweep_new_threads(self) -> None:
        """Threads started after `apply` inherit the group; a thread created by a helper outside
        the group (rare) is moved in too."""
        if self.group is None or self.version != 1:
            return
        inside = set(_read_ids(self.group / "tasks"))
        for p in self.processes:
            for tid in p.threads(self.proc):
                if tid not in inside:
                    self.moved += _move(self.group / "tasks", tid)

    def held_back(self) -> str:
        """What the quota did so far, from the group's cpu.stat: in how many scheduler periods it
        stopped the rank, and for how long. A quota above what the rank asks for binds rarely."""
        if self.group is None:
            return ""
        try:
            stat = dict(line.split() for line in (self.group / "cpu.stat").read_text().splitlines() if line.strip())
            periods, throttled = int(stat["nr_periods"]), int(stat["nr_throttled"])
            seconds = int(stat["throttled_time"]) / 1e9 if "throttled_time" in stat \
                else int(stat["throttled_usec"]) / 1e6
        except (OSError, KeyError, ValueError):
            return ""
        if not periods:
            return "the quota never had to act"
        return (f"the quota stopped it in {throttled} of {periods} periods ({throttled / periods:.0%}), "
                f"{seconds:.1f} s in all (summed over CPUs)")

    def release(self) -> None:
        """Every thread back where it was (its own cgroup, which is the group's parent unless v2
        put the group higher up), the group removed, the cpu controller off again where v2 turned
        it on. Safe to call twice."""
        if self.group is None:
            return
        state = {"origins": {str(pid): str(origin) for pid, origin in self.origins.items()},
                 "enabled_cpu": str(self.enabled) if self.enabled else None}
        release_group(self.group, self.version, state)
        self.group = None


def _enable_cpu(directory: Path) -> bool | None:
    """Make the cpu controller reach `directory`'s children: True if this call turned it on,
    False if it already was, None if it cannot be (ENOENT: not passed down from above)."""
    subtree = directory / "cgroup.subtree_control"
    try:
        if "cpu" in subtree.read_text().split():
            return False
        subtree.write_text("+cpu")
        return True
    except OSError:
        return None


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:  # a failed write() names no file
        raise OSError(exc.errno, f"{exc.strerror} (writing {text!r} to {path})") from exc


def _move(target: Path, task_id: int) -> int:
    try:
        target.write_text(str(task_id))
        return 1
    except ProcessLookupError:  # exited meanwhile
        return 0
    except OSError as exc:
        if exc.errno == 3:  # ESRCH
            return 0
        # A failed write() names no file: say which move the kernel refused.
        raise OSError(exc.errno, f"{exc.strerror} (writing {task_id} to {target})") from exc


def _read_ids(path: Path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except OSError:
        return []


def _state_file(group: Path) -> Path:
    return STATE_DIR / f"{group.name}.json"


def _save_state(group: Path, origins: dict[int, Path], enabled: Path | None) -> None:
    """Record (v2) each process's own cgroup where it is not the group's parent, and the level
    where the cpu controller was turned on for the fault, for a `release` in another process."""
    away = {str(pid): str(origin) for pid, origin in origins.items() if origin != group.parent}
    if away or enabled:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        _state_file(group).write_text(json.dumps({"group": str(group), "origins": away,
                                                  "enabled_cpu": str(enabled) if enabled else None}))


def _load_state(group: Path) -> dict:
    try:
        state = json.loads(_state_file(group).read_text())
    except (OSError, ValueError):
        return {}
    return state if state.get("group") == str(group) else {}


def _enabled_by_a_fault(directory: Path) -> bool:
    """Whether a live fault group's record says it turned cpu on at `directory` (the last fault
    out turns it off)."""
    if not STATE_DIR.is_dir():
        return False
    for record in STATE_DIR.glob(f"{GROUP_PREFIX}*.json"):
        try:
            state = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if state.get("enabled_cpu") == str(directory) and Path(state.get("group", "")).is_dir():
            return True
    return False


def _undo_state(group: Path, state: dict) -> None:
    """After the group is gone: turn cpu off where the fault turned it on, unless another fault
    group under that level still uses it; forget the record."""
    enabled = state.get("enabled_cpu")
    if enabled and not any(Path(enabled).glob(f"{GROUP_PREFIX}*")):
        try:
            (Path(enabled) / "cgroup.subtree_control").write_text("-cpu")
        except OSError:  # a cgroup made meanwhile by someone else passes cpu on below: it stays
            pass
    _state_file(group).unlink(missing_ok=True)


def release_group(group: Path, version: int, state: dict | None = None) -> None:
    """Move what is still inside `group` back to its own cgroup (v2: from `state`, else from the
    record `throttle` left) or else to the group's parent, remove it (retrying briefly: a thread
    may be created while the group is emptied), and on v2 turn off the cpu controller where the
    fault turned it on."""
    members = "tasks" if version == 1 else "cgroup.procs"
    if state is None:
        state = _load_state(group) if version == 2 else {}
    for pid, origin in state.get("origins", {}).items():
        try:
            _move(Path(origin) / "cgroup.procs", int(pid))
        except OSError:  # its cgroup is gone: it goes to the group's parent below
            pass
    for _ in range(50):
        for task_id in _read_ids(group / members):
            _move(group.parent / members, task_id)
        try:
            group.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            time.sleep(0.02)
            continue
        if version == 2:
            _undo_state(group, state)
        return
    raise FaultError(f"could not remove {group}: tasks keep appearing in it")


def leftover_groups(root: Path = CGROUP_ROOT) -> list[tuple[Path, int]]:
    """Fault groups on this host (left by a `throttle` that was killed before it could undo)."""
    found = []
    for version, hierarchy in ((1, root / "cpu"), (2, root)):
        if not hierarchy.is_dir() or (version == 2 and not (root / "cgroup.controllers").exists()):
            continue
        for group in hierarchy.rglob(f"{GROUP_PREFIX}*"):
            if group.is_dir():
                found.append((group, version))
    return found


# ---------------------------------------------------------------------------------------- commands


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
    parser.description = __doc__.split("\n\n")[0]
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
