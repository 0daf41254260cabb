"""How a rank identifies its host and the address it advertises to peers."""
from __future__ import annotations

import os
import socket


def host_key() -> str:
    """Ranks with equal keys talk over shared memory.

    The key is the kernel boot id plus the network namespace: shared memory needs the same
    kernel, and the segment hand-over uses an abstract Unix socket, which is only reachable
    inside one network namespace. Two containers or `ip netns` namespaces on one machine
    therefore count as two hosts and use TCP (or verbs).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "net:?"
    return f"{boot}/{netns}"


def default_host() -> str:
    """An address of this host that peers can reach.

    With MASTER_ADDR set (torchrun and friends), the local address of the route towards it is
    the one the other ranks can reach too; otherwise the host name's address.
    """
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))  # UDP connect sends nothing; it only picks a route
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
