"""Multi-process tests of shm_tensor_rdma over real shared memory and TCP.

Each scenario runs once per module (real processes are the slow part) and the checks it
recorded are asserted one test at a time, so a failure names the behaviour that broke.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from strdma_harness import finish_ranks, run_ranks, shm_names_of, start_ranks


@pytest.fixture(scope="module", params=["shm", "tcp"])
def basics(request, tmp_path_factory):
    transports = "shm,tcp" if request.param == "shm" else "tcp"
    run = run_ranks("basics", 2, tmp_path_factory.mktemp("basics"), transports=transports, timeout=60)
    run.transport = request.param
    return run


@pytest.mark.parametrize("rank", [0, 1])
def test_transport_is_chosen_by_peer_address(basics, rank):
    assert basics.check(rank, "transport")["detail"] == basics.transport


@pytest.mark.parametrize("rank", [0, 1])
def test_every_dtype_and_shape_round_trips_bit_exact(basics, rank):
    basics.check(rank, "dtypes_roundtrip")


def test_later_smaller_transfers_complete_before_an_earlier_large_one(basics):
    order = basics.check(1, "out_of_order")["detail"]
    assert order.index("small") < order.index("large"), order


@pytest.mark.parametrize("rank", [0, 1])
def test_dtype_and_size_mismatch_fail_with_both_ranks_named(basics, rank):
    basics.check(rank, "mismatch")


@pytest.mark.parametrize("rank", [0, 1])
def test_wait_timeout_and_transfer_timeout_raise_naming_the_peer(basics, rank):
    basics.check(rank, "timeouts")


def test_poll_reports_each_finished_handle_once(basics):
    basics.check(1, "poll_once")


def test_clean_exit_leaves_nothing_in_dev_shm(basics):
    assert basics.returncodes == [0, 0], basics.describe()
    for rank in (0, 1):
        basics.check(rank, "closed")
    assert shm_names_of(basics.job_id) == []


def test_1000_random_concurrent_transfers_between_4_ranks_are_bit_exact(tmp_path):
    run = run_ranks("mesh", 4, tmp_path, timeout=80, extra=["--count", "1000"])
    total = 0
    for rank in range(4):
        detail = run.check(rank, "random_transfers")["detail"]
        assert detail["transports"] == ["shm"], detail
        total += detail["transfers"]
    assert total == 2000  # each transfer is one send and one receive
    assert run.returncodes == [0, 0, 0, 0], run.describe()
    assert shm_names_of(run.job_id) == []


def test_ranks_on_two_hosts_mix_shared_memory_and_tcp_in_one_endpoint(tmp_path):
    run = run_ranks("mesh", 4, tmp_path, timeout=80, extra=["--count", "400", "--hosts", "2"])
    for rank in range(4):
        detail = run.check(rank, "random_transfers")["detail"]
        assert detail["transports"] == ["shm", "tcp"], detail
    assert run.returncodes == [0, 0, 0, 0], run.describe()


@pytest.mark.parametrize("transports", ["shm,tcp", "tcp"])
def test_kill_9_of_a_rank_raises_peer_error_and_leaves_no_shm(tmp_path, transports):
    procs, store, job_id, out = start_ranks("dead_peer", 2, tmp_path, transports=transports)
    deadline = time.monotonic() + 40
    while not (out / "victim.ready").exists() and time.monotonic() < deadline and procs[1].poll() is None:
        time.sleep(0.02)
    assert (out / "victim.ready").exists(), (out / "rank1.log").read_text()
    os.kill(procs[1].pid, signal.SIGKILL)
    run = finish_ranks(procs, store, job_id, out, timeout=40)
    detail = run.check(0, "peer_death")["detail"]
    assert detail["detected_after_s"] < 5, detail
    assert all("rank 1" in message for message in detail["errors"]), detail
    assert run.returncodes == [0, -signal.SIGKILL], run.describe()
    assert shm_names_of(job_id) == []


def _pid_namespaces_work() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module", params=["single-copy", "two-copies", "pid-namespace"])
def copy_paths(request, tmp_path_factory):
    """Large messages between two processes: with single copy (the default here), with it
    turned off, and with the kernel refusing it (rank 1 in its own pid namespace, as in a
    container of its own: its pid means nothing to rank 0)."""
    kwargs = {}
    if request.param == "two-copies":
        kwargs["extra"] = ["--two-copies"]
    if request.param == "pid-namespace":
        if not _pid_namespaces_work():
            pytest.skip("unshare --pid does not work here (needs root or user namespaces)")
        kwargs["prefixes"] = [[], ["unshare", "--pid", "--fork"]]
    run = run_ranks("copy_paths", 2, tmp_path_factory.mktemp("copy"), timeout=90, **kwargs)
    run.mode = request.param
    return run


@pytest.mark.parametrize("rank", [0, 1])
def test_copy_path_is_single_copy_unless_turned_off_or_refused_with_the_reason(copy_paths, rank):
    path = copy_paths.check(rank, "copy_path")["detail"]
    if copy_paths.mode == "single-copy":
        assert path == "single copy (cross-memory attach)"
    elif copy_paths.mode == "two-copies":
        assert path == "two copies through the ring (single copy disabled by configuration)"
    else:
        assert path.startswith("two copies through the ring (") and f"rank {1 - rank}" in path, path
        assert "refused" in path or "different process" in path, path


@pytest.mark.parametrize("rank", [0, 1])
def test_large_messages_are_bit_exact_on_every_copy_path(copy_paths, rank):
    copy_paths.check(rank, "backlog")
    copy_paths.check(rank, "stream")
    assert copy_paths.returncodes == [0, 0], copy_paths.describe()


def test_a_receiver_with_a_backlog_lets_the_sender_write_and_reads_the_rest(copy_paths):
    paths = [copy_paths.check(rank, "paths")["detail"] for rank in (0, 1)]
    if copy_paths.mode != "single-copy":
        assert all(p["read"] == p["written"] == 0 and p["copied"] >= 40 for p in paths), paths
        return
    # Backlog: the 12 MiB and 2 MiB messages find more waiting, so rank 0 writes them; the
    # others (three below the hand-over size and the last one) rank 1 reads.
    assert all(p["copied"] == 0 for p in paths), paths
    assert all(p["written"] >= 2 and p["read"] >= 4 for p in paths), paths
    assert paths[0]["read"] + paths[0]["written"] == paths[1]["read"] + paths[1]["written"], paths


def test_a_polling_ping_pong_wakes_no_receive_thread(copy_paths):
    if copy_paths.mode != "single-copy":
        pytest.skip("the same fast path in every mode; measured once")
    for rank in (0, 1):
        detail = copy_paths.check(rank, "ping_pong")["detail"]
        # Each rank waits for the other's answer in a polling caller; a wake-up only happens
        # when a rank was descheduled for longer than the poll (50 us) and fell asleep.
        assert detail["wakeups"] <= detail["rounds"] // 20, detail
