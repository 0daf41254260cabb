"""TCP between two "hosts": two network namespaces joined by a veth pair on this machine.

The ranks get different host keys (the network namespace is part of it), so the endpoint
picks TCP by itself. Needs root (CAP_NET_ADMIN) and iproute2; skips with the reason otherwise.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

from strdma_harness import run_ranks, shm_names_of


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed (CI: apt-get install -y iproute2)")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root (CAP_NET_ADMIN)")
    suffix = f"{os.getpid() % 100000}{random.randrange(100)}"
    namespaces = [f"strdma{suffix}a", f"strdma{suffix}b"]
    veths = [f"sv{suffix}a", f"sv{suffix}b"]
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
    made = _ip("netns", "add", namespaces[0])
    if made.returncode != 0:
        pytest.skip(f"'ip netns add' is not permitted here: {made.stderr.strip()}")
    created = [namespaces[0]]
    try:
        steps = [
            ("netns", "add", namespaces[1]),
            ("link", "add", veths[0], "type", "veth", "peer", "name", veths[1]),
            ("link", "set", veths[0], "netns", namespaces[0]),
            ("link", "set", veths[1], "netns", namespaces[1]),
            ("-n", namespaces[0], "addr", "add", f"{subnet}.1/24", "dev", veths[0]),
            ("-n", namespaces[1], "addr", "add", f"{subnet}.2/24", "dev", veths[1]),
            ("-n", namespaces[0], "link", "set", veths[0], "up"),
            ("-n", namespaces[1], "link", "set", veths[1], "up"),
        ]
        for step in steps:
            result = _ip(*step)
            if step[:2] == ("netns", "add") and result.returncode == 0:
                created.append(step[2])
            if result.returncode != 0:
                pytest.skip(f"cannot build the veth test network ({' '.join(step)}): {result.stderr.strip()}")
        yield namespaces, [f"{subnet}.1:29517", f"{subnet}.2:29518"]
    finally:
        for namespace in created:  # deleting a namespace also deletes its veth end
            _ip("netns", "del", namespace)


def test_tcp_between_two_network_namespaces(two_hosts, tmp_path):
    namespaces, addresses = two_hosts
    prefixes = [["ip", "netns", "exec", namespace] for namespace in namespaces]
    run = run_ranks("exchange", 2, tmp_path, addresses=addresses, prefixes=prefixes, timeout=60)
    for rank in (0, 1):
        assert run.check(rank, "transport")["detail"] == "tcp"
        run.check(rank, "exchange")
    assert run.returncodes == [0, 0], run.describe()
    assert shm_names_of(run.job_id) == []
