"""RDMA verbs transport: build detection, device listing, the device-independent connection
logic, and (only where an RDMA device with an active port exists) a real exchange."""
from __future__ import annotations

import os
import struct
import uuid

import pytest
import torch

from megatron.shm_tensor_rdma import EndpointConfig, PeerError, _C, rdma_ports, verbs_compiled
from strdma_harness import make_pair

logic = _C.verbs_logic
PORTS, NO_PORTS_REASON = rdma_ports()
ACTIVE = [p for p in PORTS if "state=ACTIVE" in p]


def test_build_includes_verbs_exactly_when_the_headers_exist():
    forced = os.environ.get("SHM_TENSOR_RDMA_VERBS")
    expected = forced == "1" if forced is not None else os.path.exists("/usr/include/infiniband/verbs.h")
    assert verbs_compiled() == expected


def test_device_listing_explains_an_empty_result():
    if not PORTS:
        assert NO_PORTS_REASON, "an empty device list must come with a reason"
    for line in PORTS:
        assert " port " in line and "state=" in line


def test_rdma_writes_cover_the_buffer_exactly_once():
    assert logic.plan_rdma_writes(0, 1 << 20) == [(0, 0)]
    assert logic.plan_rdma_writes(10, 4) == [(0, 4), (4, 4), (8, 2)]
    plan = logic.plan_rdma_writes((5 << 30) + 7, 1 << 30)
    assert sum(n for _, n in plan) == (5 << 30) + 7 and len(plan) == 6
    assert all(offset == i * (1 << 30) for i, (offset, _) in enumerate(plan))
    with pytest.raises(ValueError, match="max_write"):
        logic.plan_rdma_writes(10, 0)


def test_connection_info_round_trips_and_bad_records_name_the_peer():
    roce_gid = bytes([0xFE, 0x80] + [0] * 13 + [1])
    assert logic.conn_info_roundtrip(1234, 0xABCDE, 0, 5, roce_gid, 1) == (1234, 0xABCDE, 0, 5, True)
    assert logic.conn_info_roundtrip(99, 1, 7, 3, bytes(16), 1)[-1] is False  # InfiniBand: LID routing
    assert logic.common_mtu(5, 3) == 3
    bad = [
        (b"short", "sent verbs connection info of 5 bytes"),
        (struct.pack("<I", 0xDEADBEEF) + bytes(32), "malformed"),
    ]
    good = bytearray(_record(qp_num=77, psn=5, mtu=4))
    assert logic.conn_info_decode(bytes(good), 2) == (77, 5, 0, 4)
    bad.append((_record(qp_num=0, psn=5, mtu=4), "invalid queue pair number or PSN"))
    bad.append((_record(qp_num=7, psn=1 << 24, mtu=4), "invalid queue pair number or PSN"))
    bad.append((_record(qp_num=7, psn=5, mtu=9), "invalid path MTU code 9"))
    for raw, message in bad:
        with pytest.raises(_C.PeerSetupError) as info:
            logic.conn_info_decode(raw, 2)
        assert message in info.value.args[0] and info.value.args[1] == 2
        assert "rank 2" in info.value.args[0]


def _record(qp_num: int, psn: int, mtu: int) -> bytes:
    # Layout of VerbsConnInfo (csrc/verbs_logic.h): magic, qp_num, psn, lid, port, gid_index, mtu, gid.
    return struct.pack("<IIIHBBI16s", 0x56524253, qp_num, psn, 0, 1, 0, mtu, bytes(16))


def test_immediate_tokens_are_nonzero_unique_and_single_use():
    table = logic.ImmTokenTable()
    tokens = [table.add(100 + i) for i in range(1000)]
    assert 0 not in tokens and len(set(tokens)) == 1000 and len(table) == 1000
    assert table.take(tokens[5]) == 105
    assert table.take(tokens[5]) == 0  # a duplicate completion cannot complete twice
    assert table.drop(tokens[6]) and not table.drop(tokens[6])
    assert table.take(0) == 0


@pytest.mark.skipif(bool(ACTIVE), reason="an RDMA device is present; covered by the data-path test")
def test_verbs_only_endpoints_without_a_device_fail_setup_with_the_reason():
    config = EndpointConfig(transports=("verbs",), connect_timeout=10)
    # Distinct host keys make the two endpoints "remote" to each other, as across machines.
    configs = [EndpointConfig(transports=("verbs",), connect_timeout=10, host_key=f"host-{r}") for r in (0, 1)]
    with pytest.raises(PeerError) as info:
        make_pair(config=config, per_rank_configs=configs)
    assert "no transport usable with rank" in str(info.value)


@pytest.mark.skipif(not ACTIVE, reason=f"no RDMA device with an active port ({NO_PORTS_REASON or PORTS}): "
                                       "the verbs data path is not exercised on this machine")
def test_verbs_exchange_between_two_endpoints():  # pragma: no cover - needs RDMA hardware
    configs = [EndpointConfig(transports=("verbs",), host_key=f"host-{r}-{uuid.uuid4().hex}") for r in (0, 1)]
    a, b = make_pair(per_rank_configs=configs)
    try:
        assert a.transport(1) == "verbs"
        data = torch.randn(1 << 20)
        receive = b.irecv(((1 << 20,), torch.float32), 0, tag=1)
        a.isend(data, 1, tag=1).wait(30)
        assert torch.equal(receive.wait(30), data)
    finally:
        a.close()
        b.close()
