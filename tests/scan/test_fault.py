"""`python -m megatron.scan fault`: faults applied to a running process from outside, found by the
RANK in its environment. The throttle must reach every thread, be undone on Ctrl-C, when the
target ends, and by `release` after the tool itself was killed; nothing may stay in the cgroups."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fault_runs import writable_hierarchy
from launch import ROOT, env, free_port
from megatron.scan.fault import cgroups, targets

CPU = Path("/sys/fs/cgroup/cpu")


HIERARCHY = writable_hierarchy()
cgroup_writable = pytest.mark.skipif(HIERARCHY is None, reason="needs a writable cgroup cpu hierarchy (root; v1 "
                                     "/sys/fs/cgroup/cpu, or v2 /sys/fs/cgroup with the cpu controller)")
SPINNER = "import threading, time\n" \
          "def spin():\n    while True: pass\n" \
          "for _ in range(2): threading.Thread(target=spin, daemon=True).start()\n" \
          "time.sleep(120)\n"


def subtree_controls() -> dict[str, str]:
    """v2: the controllers each level from the root to this process's cgroup passes on (a fault
    that turned one on must turn it off again)."""
    if HIERARCHY is None or HIERARCHY[0] != 2:
        return {}
    own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
               if line.startswith("0:"))
    levels = [HIERARCHY[1] / own.lstrip("/")]
    levels += [a for a in levels[0].parents if a == HIERARCHY[1] or HIERARCHY[1] in a.parents]
    return {str(level): (level / "cgroup.subtree_control").read_text().strip() for level in levels}


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = subtree_controls()
    yield
    assert subtree_controls() == before, "a cgroup level passes on other controllers than before the fault"
    left = cgroups.leftover_groups()
    for group, version in left:
        cgroups.release_group(group, version)
    assert not left, f"fault cgroups left behind: {left}"
    assert not list(cgroups.STATE_DIR.glob(f"{cgroups.GROUP_PREFIX}*")), "a v2 origins record was left behind"


@pytest.fixture
def worker():
    """A stand-in for a torchrun worker: RANK/MASTER_PORT in its environment, three threads."""
    port = free_port()
    child_env = {**env(), "RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-c", SPINNER], env=child_env)
    deadline = time.monotonic() + 10
    while len(os.listdir(f"/proc/{proc.pid}/task")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield proc, port
    proc.kill()
    proc.wait()


def cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron.scan", "fault", *args], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def wait_for_line(proc: subprocess.Popen, text: str) -> str:
    line = proc.stdout.readline()
    assert text in line, line + proc.stdout.read()
    return line


def cpu_cgroup(tid_path: Path) -> str:
    """The thread's cgroup in the hierarchy the throttle uses (v1's cpu line, v2's unified one)."""
    for line in (tid_path / "cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if (HIERARCHY[0] == 1 and "cpu" in controllers.split(",")) or (HIERARCHY[0] == 2 and number == "0"):
            return path
    raise AssertionError("no cpu cgroup line")


def quota_group(line: str) -> Path:
    """The quota group the tool's "throttled" line names (v2 may put it above the rank's cgroup)."""
    match = re.search(r"\(cgroup v(\d) (\S+)\)", line)
    assert match and int(match[1]) == HIERARCHY[0], line
    return Path(match[2])


def relative(group: Path) -> str:
    return "/" + str(group.relative_to(HIERARCHY[1]))


def quota_setting(group: Path) -> str:
    return (group / ("cpu.cfs_quota_us" if HIERARCHY[0] == 1 else "cpu.max")).read_text().strip()


def thread_groups(pid: int) -> set[str]:
    return {cpu_cgroup(Path(f"/proc/{pid}/task/{tid}")) for tid in os.listdir(f"/proc/{pid}/task")}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@cgroup_writable
def test_throttle_limits_every_thread_and_ctrl_c_releases(worker):
    proc, port = worker
    before = thread_groups(proc.pid)
    tool = cli("throttle", "--rank", "3", "--job", f":{port}", "--cpu-fraction", "0.2")
    line = wait_for_line(tool, "[fault] throttled rank 3")
    group = quota_group(line)
    assert group.name == f"{cgroups.GROUP_PREFIX}{proc.pid}"
    assert thread_groups(proc.pid) == {relative(group)}, line  # all three threads, not just the main one
    assert quota_setting(group) == ("20000" if HIERARCHY[0] == 1 else "20000 100000")
    start = cpu_seconds(proc.pid)
    time.sleep(1.5)
    rate = (cpu_seconds(proc.pid) - start) / 1.5
    assert rate < 0.4, f"two spinning threads used {rate:.2f} cores under a 0.2-core quota"
    tool.send_signal(signal.SIGINT)
    out, _ = tool.communicate(timeout=20)
    assert tool.returncode == 0 and "released rank 3" in out and "SIGINT" in out, out
    # Two spinning threads want 2 cores against 0.2: the quota acts in (nearly) every period.
    periods = re.search(r"the quota stopped it in (\d+) of (\d+) periods", out)
    assert periods and int(periods[2]) >= 10 and int(periods[1]) >= 0.8 * int(periods[2]), out
    assert thread_groups(proc.pid) == before
    assert not group.exists()


@cgroup_writable
def test_throttle_ends_with_the_rank_and_leaves_nothing(worker):
    proc, port = worker
    tool = cli("throttle", "--rank", "3", "--job", f":{port}", "--cpu-fraction", "0.5")
    group = quota_group(wait_for_line(tool, "[fault] throttled"))
    proc.kill()
    proc.wait()
    out, _ = tool.communicate(timeout=20)
    assert tool.returncode == 0 and "the rank's processes ended" in out, out
    assert not group.exists()


@cgroup_writable
def test_release_undoes_a_throttle_whose_tool_was_killed(worker):
    """Back in its own cgroup even on v2, where the quota group may sit above it."""
    proc, port = worker
    before = thread_groups(proc.pid)
    tool = cli("throttle", "--rank", "3", "--job", f":{port}", "--cpu-fraction", "0.3")
    group = quota_group(wait_for_line(tool, "[fault] throttled"))
    tool.kill()  # no chance to undo
    tool.wait()
    assert thread_groups(proc.pid) == {relative(group)}
    out = subprocess.run([sys.executable, "-m", "megatron.scan", "fault", "release"], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and f"released {group}" in out.stdout, out
    assert thread_groups(proc.pid) == before
    assert not cgroups.leftover_groups()


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_freeze_stops_the_rank_until_released(worker):
    proc, port = worker
    tool = cli("freeze", "--rank", "3", "--job", f":{port}", "--for", "30")
    wait_for_line(tool, "[fault] froze rank 3")
    assert process_state(proc.pid) == "T"
    tool.send_signal(signal.SIGTERM)
    out, _ = tool.communicate(timeout=20)
    assert tool.returncode == 0 and "continued rank 3" in out, out
    assert process_state(proc.pid) in "RS"


def test_kill_sends_the_signal(worker):
    proc, port = worker
    out = subprocess.run([sys.executable, "-m", "megatron.scan", "fault", "kill", "--rank", "3", "--job", f":{port}",
                          "--signal", "TERM"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "SIGTERM" in out.stdout, out
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_bad_targets_say_what_to_change(worker):
    proc, port = worker

    def run(*args):
        return subprocess.run([sys.executable, "-m", "megatron.scan", "fault", *args], cwd=ROOT, env=env(),
                              capture_output=True, text=True, timeout=30)

    missing = run("throttle", "--rank", "99", "--cpu-fraction", "0.5")
    assert missing.returncode == 2 and "no process with RANK=99" in missing.stderr and "fault list" in missing.stderr
    second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**env(), "RANK": "3", "MASTER_PORT": str(port + 1)})
    try:
        time.sleep(0.5)
        ambiguous = run("freeze", "--rank", "3")
        # (other jobs on this host may have a RANK=3 too: both of ours must be listed)
        assert ambiguous.returncode == 2 and "RANK=3 exists in" in ambiguous.stderr and "--job" in ambiguous.stderr
        assert f":{port}" in ambiguous.stderr and f":{port + 1}" in ambiguous.stderr
    finally:
        second.kill()
        second.wait()
    listed = run("list")
    assert f":{port}" in listed.stdout and str(proc.pid) in listed.stdout
    if (CPU / "cpu.cfs_quota_us").exists():
        zero = run("throttle", "--rank", "3", "--job", f":{port}", "--cpu-fraction", "0")
        assert zero.returncode == 2 and "--cpu-fraction must be > 0" in zero.stderr


def fake_v2_host(tmp_path: Path, *, root_passes_cpu: bool = True) -> tuple[Path, Path, targets.RankProcess]:
    """A cgroup v2 tree as a VM's service manager leaves it: the job in /process_api/job, neither
    level passing the cpu controller on (their subtree_control cannot be written: directories
    here, so that writing fails as the kernel's ENOENT / EBUSY does), only the root does."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    job = root / "process_api" / "job"
    job.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    if root_passes_cpu:
        (root / "cgroup.subtree_control").write_text("cpuset cpu io memory pids\n")
    else:
        (root / "cgroup.subtree_control").mkdir()
    for level in (root / "process_api", job):
        (level / "cgroup.subtree_control").mkdir()
    (proc / "4242" / "task" / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text("0::/process_api/job\n")
    return root, job, targets.RankProcess(pid=4242, rank=1, local_rank=1, job="-", command="python")


def test_v2_quota_goes_where_the_cpu_controller_reaches_and_comes_back(tmp_path, monkeypatch):
    """On an H100 VM (cgroup v2, job in /process_api/<id>) the throttle failed with a traceback
    while enabling cpu in the job's own cgroup, and the benchmark went on as if it had applied."""
    root, job, target = fake_v2_host(tmp_path)
    monkeypatch.setattr(cgroups, "STATE_DIR", tmp_path / "state")
    released = []
    removable_release(monkeypatch, released)
    quota = cgroups.CpuQuota(0.15, [target], root=root, proc=tmp_path / "proc")
    quota.apply()
    assert quota.version == 2 and quota.group == root / f"{cgroups.GROUP_PREFIX}4242"
    assert (quota.group / "cpu.max").read_text() == "15000 100000"
    assert (quota.group / "cgroup.procs").read_text() == "4242" and quota.moved == 1
    quota.release()
    assert (job / "cgroup.procs").read_text() == "4242"  # back in its own cgroup, not in the root
    assert released == [(root / f"{cgroups.GROUP_PREFIX}4242", 2)]


def removable_release(monkeypatch, released: list) -> None:
    """release_group on the fake tree: its files go first, as a real cgroup's go with rmdir."""
    real = cgroups.release_group

    def release(group: Path, version: int, state=None):
        released.append((group, version))
        for file in group.iterdir():
            file.unlink()
        real(group, version, state)
    monkeypatch.setattr(cgroups, "release_group", release)


def test_v2_origin_is_kept_for_release_after_the_tool_was_killed(tmp_path, monkeypatch):
    """`fault release` runs in another process than the killed `throttle`: where the rank came
    from must be on disk, written before it was moved, and gone once it is back."""
    root, job, target = fake_v2_host(tmp_path)
    monkeypatch.setattr(cgroups, "STATE_DIR", tmp_path / "state")
    quota = cgroups.CpuQuota(0.15, [target], root=root, proc=tmp_path / "proc")
    quota.apply()
    record = tmp_path / "state" / f"{cgroups.GROUP_PREFIX}4242.json"
    assert json.loads(record.read_text())["origins"] == {"4242": str(job)}
    removable_release(monkeypatch, [])
    cgroups.release_group(quota.group, 2)  # what `fault release` does, from the record alone
    assert (job / "cgroup.procs").read_text() == "4242" and not record.exists()


def test_v2_never_turns_a_cgroup_with_processes_into_a_thread_root(tmp_path, monkeypatch):
    """On the H100 VM the job's own cgroup could take "+cpu" once /process_api passed cpu down:
    with processes in it that made it a thread root, its new child refused the rank (EOPNOTSUPP)
    and the change outlived the fault. A level with processes is skipped; the level the fault
    turned cpu on at is turned off again by the last fault to leave it."""
    root, job, _ = fake_v2_host(tmp_path)
    monkeypatch.setattr(cgroups, "STATE_DIR", tmp_path / "state")
    api = root / "process_api"
    for level, controllers in ((api, "memory"), (job, "")):
        (level / "cgroup.subtree_control").rmdir()
        (level / "cgroup.subtree_control").write_text(controllers)
    (job / "cgroup.procs").write_text("4242\n4343\n")
    (tmp_path / "proc" / "4343" / "task" / "4343").mkdir(parents=True)
    (tmp_path / "proc" / "4343" / "cgroup").write_text("0::/process_api/job\n")
    first, second = (cgroups.CpuQuota(0.2, [targets.RankProcess(pid=pid, rank=r, local_rank=r, job="-", command="x")],
                                    root=root, proc=tmp_path / "proc") for r, pid in ((0, 4242), (1, 4343)))
    first.apply()
    assert first.group.parent == api and first.enabled == api
    assert (job / "cgroup.subtree_control").read_text() == ""  # the job's cgroup was never asked
    (api / "cgroup.subtree_control").write_text("cpu memory")  # what the kernel shows after "+cpu"
    second.apply()  # cpu is on already, turned on by a live fault: the last one out turns it off
    assert second.group.parent == api and second.enabled == api
    removable_release(monkeypatch, [])
    first.release()
    assert (api / "cgroup.subtree_control").read_text() == "cpu memory"  # the second still needs it
    second.release()
    assert (api / "cgroup.subtree_control").read_text() == "-cpu"
    assert not list((tmp_path / "state").iterdir())


def test_v2_host_where_no_level_passes_cpu_on_says_what_to_change(tmp_path):
    root, _, target = fake_v2_host(tmp_path, root_passes_cpu=False)
    with pytest.raises(targets.FaultError, match=r"cpu controller cannot be enabled .*from the root down"):
        cgroups.CpuQuota(0.15, [target], root=root, proc=tmp_path / "proc").apply()
    assert not list(root.rglob(f"{cgroups.GROUP_PREFIX}*"))
