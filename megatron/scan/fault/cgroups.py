"""The CPU quota of `fault throttle`: a cgroup (v1 or v2) holding a rank's threads, and what puts
everything back (`release_group`, also from another process after a killed `throttle`)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

from megatron.scan.fault.targets import PROC, FaultError, RankProcess

GROUP_PREFIX = "megascan-fault-"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v2 may put the quota group above the rank's own cgroup; where each process came from is
# kept here too, so that `release` after a killed `throttle` sends it back there, not to the group's parent.
STATE_DIR = Path(os.environ.get("MEGASCAN_FAULT_STATE_DIR", "/run/megascan-fault"))


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
                for p in self.processes:  # v2 moves whole processes (all their threads)
                    if p.pid in self.origins and _move(self.group / "cgroup.procs", p.pid):
                        self.moved += len(p.threads(self.proc))
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
