#!/usr/bin/env bash
# Prerequisites of the RDMA verbs transport of megatron/shm_tensor_rdma, then a list of the
# RDMA devices and ports this machine has.
#
#   ./prerequisite.sh            install Debian packages (needs root or sudo), then list devices
#   ./prerequisite.sh --list     only list devices
#
# Packages: rdma-core (udev rules, kernel module loading), libibverbs-dev (headers and
# libibverbs.so: the build compiles the verbs transport only when <infiniband/verbs.h> exists),
# ibverbs-providers (the user-space NIC drivers), ibverbs-utils (ibv_devinfo),
# python3-pyverbs (Python bindings used for the listing below), iproute2 (`ip netns`, used by
# the TCP tests). After installing, rebuild the extension: pip install -e . --no-build-isolation
set -euo pipefail

PACKAGES=(rdma-core libibverbs-dev ibverbs-providers ibverbs-utils python3-pyverbs iproute2)

install_packages() {
    local sudo=""
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null; then
            sudo="sudo"
        else
            echo "prerequisite.sh: not root and no sudo; install as root: apt-get install -y ${PACKAGES[*]}" >&2
            return 1
        fi
    fi
    if ! command -v apt-get >/dev/null; then
        echo "prerequisite.sh: apt-get not found; install the equivalents of: ${PACKAGES[*]}" >&2
        return 1
    fi
    echo "Installing: ${PACKAGES[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
}

# pyverbs from Debian lives in the system interpreter's dist-packages; fall back to the
# `pyverbs` wheel for another interpreter only when the Debian package is not importable.
pick_python() {
    for candidate in /usr/bin/python3 "${PYTHON:-python3}"; do
        if "$candidate" -c "import pyverbs.device" 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    local fallback="${PYTHON:-python3}"
    if "$fallback" -m pip install -q pyverbs >/dev/null 2>&1 && "$fallback" -c "import pyverbs.device" 2>/dev/null; then
        echo "$fallback"
        return 0
    fi
    return 1
}

list_devices() {
    local python
    if ! python=$(pick_python); then
        echo "pyverbs is not available (install python3-pyverbs or the pyverbs wheel); falling back to ibv_devinfo."
        if command -v ibv_devinfo >/dev/null && ibv_devinfo -l 2>/dev/null | grep -q .; then
            ibv_devinfo
        else
            echo "No RDMA devices found: shm_tensor_rdma will use shared memory on one host and TCP between hosts."
        fi
        return 0
    fi
    "$python" - <<'EOF'
import pyverbs.device as device
from pyverbs.pyverbs_error import PyverbsError

try:
    devices = device.get_device_list()
except PyverbsError as error:
    devices, reason = [], str(error)
else:
    reason = "the RDMA subsystem reports no devices"
if not devices:
    print(f"No RDMA devices found ({reason}).")
    print("shm_tensor_rdma will use shared memory on one host and TCP between hosts; "
          "its verbs tests are skipped.")
    raise SystemExit(0)
active = 0
for dev in devices:
    name = dev.name.decode()
    with device.Context(name=name) as ctx:
        for port in range(1, ctx.query_device().phys_port_cnt + 1):
            attr = ctx.query_port(port)
            state = device.port_state_to_str(attr.state)
            link = "Ethernet (RoCE)" if attr.link_layer == 2 else "InfiniBand"
            active += "ACTIVE" in state.upper()
            print(f"{name} port {port}: state={state} link={link} lid={attr.lid} "
                  f"active_mtu={attr.active_mtu} max_msg_sz={attr.max_msg_sz}")
if not active:
    print("RDMA devices exist but no port is ACTIVE: the verbs transport will not be used.")
else:
    print(f"{active} active RDMA port(s): the verbs transport is used between hosts.")
EOF
}

if [[ "${1:-}" != "--list" ]]; then
    install_packages || echo "prerequisite.sh: continuing without installing packages" >&2
fi
list_devices
