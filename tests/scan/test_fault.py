"""`python -m megatron.scan fault`: faults applied to a running process from outside, found by the
RANK in its environment. The throttle must reach every thread, be undone on Ctrl-C, when the
target ends, and by `release` after the tool itself was killed; nothing may stay in the cgroups."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import ROOT, env, free_port
from megatron.scan import fault

CPU = Path("/sys/fs/cgroup/cpu")
cgroup_v1 = pytest.mark.skipif(not (CPU / "cpu.cfs_quota_us").exists() or not os.access(CPU, os.W_OK),
                               reason="needs a writable cgroup v1 cpu hierarchy (root; /sys/fs/cgroup/cpu)")
SPINNER = "import threading, time\n" \
          "def spin():\n    while True: pass\n" \
          "for _ in range(2): threading.Thread(target=spin, daemon=True).start()\n" \
          "time.sleep(120)\n"


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    left = fault.leftover_groups()
    for group, version in left:
        fault.release_group(group, version)
    assert not left, f"fault cgroups left behind: {left}"


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
    for line in (tid_path / "cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    raise AssertionError("no cpu cgroup line")


def thread_groups(pid: int) -> set[str]:
    return {cpu_cgroup(Path(f"/proc/{pid}/task/{tid}")) for tid in os.listdir(f"/proc/{pid}/task")}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@cgroup_v1
def test_throttle_limits_every_thread_and_ctrl_c_releases(worker):
    proc, port = worker
    before = thread_groups(proc.pid)
    tool = cli("throttle", "--rank", "3", "--job", f":{port}", "--cpu-fraction", "0.2")
    line = wait_for_line(tool, "[fault] throttled rank 3")
    group = f"/{fault.GROUP_PREFIX}{proc.pid}"
    assert thread_groups(proc.pid) == {group}, line  # all three threads, not just the main one
    assert (CPU / group.lstrip("/") / "cpu.cfs_quota_us").read_text().strip() == "20000"
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
    assert not (CPU / group.lstrip("/")).exists()


@cgroup_v1
def test_throttle_ends_with_the_rank_and_leaves_nothing(worker):
    proc, port = worker
    tool = cli("throttle", "--rank", "3", "--job", f":{port}", "--cpu-fraction", "0.5")
    wait_for_line(tool, "[fault] throttled")
    proc.kill()
    proc.wait()
    out, _ = tool.communicate(timeout=20)
    assert tool.returncode == 0 and "the rank's processes ended" in out, out
    assert not (CPU / f"{fault.GROUP_PREFIX}{proc.pid}").exists()


@cgroup_v1
def test_release_undoes_a_throttle_whose_tool_was_killed(worker):
    proc, port = worker
    before = thread_groups(proc.pid)
    tool = cli("throttle", "--rank", "3", "--job", f":{port}", "--cpu-fraction", "0.3")
    wait_for_line(tool, "[fault] throttled")
    tool.kill()  # no chance to undo
    tool.wait()
    assert thread_groups(proc.pid) == {f"/{fault.GROUP_PREFIX}{proc.pid}"}
    out = subprocess.run([sys.executable, "-m", "megatron.scan", "fault", "release"], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and f"released {CPU / (fault.GROUP_PREFIX + str(proc.pid))}" in out.stdout, out
    assert thread_groups(proc.pid) == before
    assert not fault.leftover_groups()


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


def fake_v2_host(tmp_path: Path, *, root_passes_cpu: bool = True) -> tuple[Path, Path, fault.RankProcess]:
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
    return root, job, fault.RankProcess(pid=4242, rank=1, local_rank=1, job="-", command="python")


def test_v2_quota_goes_where_the_cpu_controller_reaches_and_comes_back(tmp_path, monkeypatch):
    """On an H100 VM (cgroup v2, job in /process_api/<id>) the throttle failed with a traceback
    while enabling cpu in the job's own cgroup, and the benchmark went on as if it had applied."""
    root, job, target = fake_v2_host(tmp_path)
    released = []
    monkeypatch.setattr(fault, "release_group", lambda group, version: released.append((group, version)))
    quota = fault.CpuQuota(0.15, [target], root=root, proc=tmp_path / "proc")
    quota.apply()
    assert quota.version == 2 and quota.group == root / f"{fault.GROUP_PREFIX}4242"
    assert (quota.group / "cpu.max").read_text() == "15000 100000"
    assert (quota.group / "cgroup.procs").read_text() == "4242" and quota.moved == 1
    quota.release()
    assert (job / "cgroup.procs").read_text() == "4242"  # back in its own cgroup, not in the root
    assert released == [(root / f"{fault.GROUP_PREFIX}4242", 2)]


def test_v2_host_where_no_level_passes_cpu_on_says_what_to_change(tmp_path):
    root, _, target = fake_v2_host(tmp_path, root_passes_cpu=False)
    with pytest.raises(fault.FaultError, match=r"cpu controller cannot be enabled .*from the root down"):
        fault.CpuQuota(0.15, [target], root=root, proc=tmp_path / "proc").apply()
    assert not list(root.rglob(f"{fault.GROUP_PREFIX}*"))
