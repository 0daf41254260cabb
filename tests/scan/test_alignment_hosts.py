"""One clock per host: ranks that share a host share its wall clock, so alignment fits one offset
(and drift) per host and window, keeps the host of rank 0 on its raw clock, and never leaves the
collective finish spread or P2P causality worse than the raw clocks were."""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.scan.aggregate import aggregate, collective_end_spread_us
from megatron.scan.synthetic import SyntheticRun, generate
from megatron.scan.trace_format import (ClockSkew, TraceWriter, decode_column, encode_column, header_fields,
                                        iter_trace_files, read_rank_file, write_lines)

HOST_A, HOST_B = "node-a/11111111-aaaa", "node-b/22222222-bbbb"


def rewrite(directory: Path, host_of: dict[int, str] | None = None, skew_ns: dict[int, int] | None = None,
            late_ns=None) -> None:
    """Edit trace files in place: give rank r the host identity host_of[r]; move its wall clock
    by skew_ns[r] (the header's and every window's reference pairs: event times are relative to
    the window's monotonic reference, so they follow); late_ns(rank, n) -> n ns added to the
    finish of each of the rank's collectives (a busy rank observing a finish late)."""
    for path in iter_trace_files(directory):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        rank = lines[0]["rank"]
        if host_of is not None:
            lines[0]["host_id"] = host_of[rank]
        shift = (skew_ns or {}).get(rank, 0)
        lines[0]["clock_reference"]["wall_ns"] += shift
        for record in lines[1:]:
            if record.get("type") != "window":
                continue
            for pair in record["clock"].values():
                pair["wall_ns"] += shift
            if late_ns is not None:
                events = record["events"]
                collective = decode_column(events["group"]) >= 0
                late = late_ns(rank, int(collective.sum()))
                if late is not None:
                    end = decode_column(events["end_ns"])
                    end[collective] += np.asarray(late, dtype=np.int64)
                    events["end_ns"] = encode_column(end)
        write_lines(path, lines)


def never_worse(alignment) -> None:
    before, after = alignment.before, alignment.after
    assert after["causality_violations"] <= before["causality_violations"], (before, after)
    for key in ("finish_spread_us_median", "finish_spread_us_p95"):
        assert after[key] <= before[key], (key, before, after)


def test_the_header_names_the_host_and_a_skewed_rank_pretends_its_own(tmp_path):
    header = header_fields(rank=3, world_size=4, run_id="unit", coordinates={"dp": 0, "pp": 0, "tp": 0}, sizes={})
    hostname, boot = header["host_id"].split("/", 1)
    assert hostname == socket.gethostname() == header["host"]
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert boot == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    writer = TraceWriter(tmp_path / "skewed.json", header, skew=ClockSkew(offset_ns=40_000_000))
    writer.close({"windows": 0})
    assert read_rank_file(tmp_path / "skewed.json").header["host_id"] == header["host_id"] + "+clock-skew-rank3"


def test_one_host_is_never_moved_by_late_collective_finishes(tmp_path, monkeypatch):
    """Ranks 1 and 6 see their collectives finish late (async completions observed by a busy rank).
    Fitted per rank (a trace without host identities), the anchors pull their clocks by
    milliseconds and put receives before their sends; causality puts them back within tens of µs.
    On one host there is nothing to align: every offset is exactly 0, the times the raw ones."""
    import megatron.scan.align_check as align_check

    spec = SyntheticRun(tp=2, pp=2, dp=2, iterations=4)
    generate(spec, tmp_path)
    rng = np.random.default_rng(1)
    late = {1: lambda n: rng.exponential(3e6, n), 6: lambda n: 2e6 + rng.exponential(0.5e6, n)}
    rewrite(tmp_path, late_ns=lambda rank, n: late[rank](n) if rank in late else None)
    with monkeypatch.context() as unchecked:
        unchecked.setattr(align_check, "worse", lambda after, before: [])
        unchecked.setattr(align_check.Causality, "respect", lambda *args: [])
        pulled = aggregate(tmp_path, None, jobs=1).alignment
    assert min(pulled.ranks[1].offset_us[0], pulled.ranks[6].offset_us[0]) > 1000, pulled.as_dict()["ranks"]
    assert pulled.after["causality_violations"] > pulled.before["causality_violations"] == 0
    per_rank = aggregate(tmp_path, None, jobs=1).alignment
    assert per_rank.clock_domains == "rank" and "no host identity" in per_rank.notes[0]
    assert "broke causality" in per_rank.notes[1]
    assert max(abs(entry.offset_us[0]) for entry in per_rank.ranks.values()) < 100, per_rank.as_dict()["ranks"]
    never_worse(per_rank)

    rewrite(tmp_path, host_of={r: HOST_A for r in range(spec.world_size)})
    result = aggregate(tmp_path, None, jobs=1)
    alignment = result.alignment
    assert alignment.clock_domains == "host" and [h.host for h in alignment.hosts] == [HOST_A]
    assert alignment.hosts[0].reference and alignment.hosts[0].offset_us == {0: 0.0}
    assert all(e.offset_us == {0: 0.0} and e.drift_ppm == {0: 0.0} for e in alignment.ranks.values())
    assert alignment.before == alignment.after and not alignment.unanchored and alignment.notes == []
    raw = aggregate(tmp_path, None, jobs=1, do_align=False)
    for column in ("start", "end"):
        assert (result.trace.columns[column] == raw.trace.columns[column]).all()


def test_causality_corrects_a_host_whose_collectives_finish_late(tmp_path):
    """Host B is 10 ms ahead and its ranks observe every collective finish 4-12 ms late: the anchors
    alone put it 15 ms off (with a drift invented to fit the lateness), which puts receives before
    their sends; the P2P messages each way bound it, and it is recovered within 0.5 ms."""
    host_b = [4, 5, 6, 7]
    spec = SyntheticRun(tp=2, pp=2, dp=2, iterations=4, offsets_ms={r: 10.0 for r in host_b})
    generate(spec, tmp_path)
    rng = np.random.default_rng(2)
    rewrite(tmp_path, host_of={r: HOST_B if r in host_b else HOST_A for r in range(spec.world_size)},
            late_ns=lambda rank, n: 4e6 + rng.exponential(4e6, n) if rank in host_b else None)
    alignment = aggregate(tmp_path, None, jobs=1).alignment
    assert "broke causality" in alignment.notes[0] and alignment.hosts[1].drift_ppm == {0: 0.0}
    assert abs(alignment.hosts[1].offset_us[0] - 10_000) < 500, (alignment.as_dict()["hosts"], alignment.notes)
    assert alignment.after["causality_violations"] == 0
    never_worse(alignment)


@pytest.mark.parametrize("drift_ppm", [0.0, 150.0])
def test_two_hosts_with_a_known_skew(tmp_path, drift_ppm):
    """Host B (pipeline stage 1: ranks 4-7) is 37 ms ahead (and drifts): it is recovered within
    0.5 ms against host A, which keeps its raw clock, one correction for all of a host's ranks."""
    host_b = [4, 5, 6, 7]
    spec = SyntheticRun(tp=2, pp=2, dp=2, iterations=4, offsets_ms={r: 37.0 for r in host_b},
                        drift_ppm={r: drift_ppm for r in host_b} if drift_ppm else {})
    generate(spec, tmp_path)
    rewrite(tmp_path, host_of={r: HOST_B if r in host_b else HOST_A for r in range(spec.world_size)})
    result = aggregate(tmp_path, tmp_path / "merged.json", jobs=1)
    alignment = result.alignment
    assert [h.host for h in alignment.hosts] == [HOST_A, HOST_B] and [h.ranks for h in alignment.hosts] == \
        [[0, 1, 2, 3], host_b]
    assert alignment.hosts[0].reference and alignment.hosts[0].offset_us == {0: 0.0}
    assert abs(alignment.hosts[1].offset_us[0] - 37_000) < 500, alignment.as_dict()["hosts"]
    for rank, entry in alignment.ranks.items():
        assert entry.offset_us == alignment.hosts[1 if rank in host_b else 0].offset_us
    if drift_ppm:
        assert abs(alignment.hosts[1].drift_ppm[0] - drift_ppm) < 40
    never_worse(alignment)
    assert alignment.before["causality_violations"] > 0 and alignment.after["causality_violations"] == 0
    # Most collectives stay within a host (the spread's p95 barely sees host B); those spanning both get tight.
    raw = aggregate(tmp_path, None, jobs=1, do_align=False)
    assert collective_end_spread_us(raw.trace, raw.collectives).max() > 30_000
    assert collective_end_spread_us(result.trace, result.collectives).max() < 200
    summary = json.loads((tmp_path / "merged.json").read_text())["otherData"]["megascan"]["alignment"]
    assert summary["before"] == alignment.before and summary["hosts"][1]["ranks"] == host_b


def test_a_correction_that_makes_the_figures_worse_is_dropped(tmp_path, monkeypatch):
    """A fit that moves a correct host (here forced: 5 ms) puts receives before their sends: the
    raw clocks break no causality bound, so they stay. Without that repair (to see the last
    guard alone), the figures made worse keep that host on its raw clock in that window, with a note."""
    import megatron.scan.align_check as align_check
    import megatron.scan.align_solve as align_solve

    fit = align_solve.Problem.fit

    def misled(self, drift, sigma=None, tick=None):
        x, r, scale = fit(self, drift, sigma, tick)
        x = x.copy()
        x[self.num_nodes - 1] += 5000.0
        return x, r, scale

    spec = SyntheticRun(tp=2, pp=2, dp=2, iterations=2)
    generate(spec, tmp_path)
    rewrite(tmp_path, host_of={r: HOST_B if r >= 4 else HOST_A for r in range(spec.world_size)})
    honest = aggregate(tmp_path, None, jobs=1).alignment
    # True clocks: the honest fit moves host B by noise at most (or, where even that made a figure
    # worse, not at all).
    assert abs(honest.hosts[1].offset_us[0]) < 50
    never_worse(honest)
    monkeypatch.setattr(align_solve.Problem, "fit", misled)
    raw = aggregate(tmp_path, None, jobs=1, do_align=False)
    repaired = aggregate(tmp_path, None, jobs=1)
    assert repaired.alignment.hosts[1].offset_us == {0: 0.0} and "kept raw" in repaired.alignment.notes[0]
    monkeypatch.setattr(align_check.Causality, "respect", lambda *args: [])
    result = aggregate(tmp_path, None, jobs=1)
    alignment = result.alignment
    assert alignment.hosts[1].kept_raw == [0] and alignment.hosts[1].offset_us == {0: 0.0}
    assert alignment.after == alignment.before
    assert any(HOST_B in note and "raw clocks kept" in note for note in alignment.notes), alignment.notes
    for aligned in (repaired, result):
        assert (aligned.trace.columns["end"] == raw.trace.columns["end"]).all()


NODE1 = [2, 3]  # torchrun gives node 1 global ranks 2 and 3 (pipeline stage 1)
SKEW_US = 37_000


def two_node_job(trace_dir: Path) -> None:
    """Two `torchrun --nnodes 2` launches of the trainer on this machine (PP=2 x DP=2, two ranks
    per "node"), traced in two windows of two iterations."""
    from launch import free_port, run_nodes

    port = free_port()
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256",
             "--device", "cpu", "--pipeline-model-parallel-size", "2"]
    results = run_nodes([[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                          "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                          "pretrain_gpt.py", *model, "--train-iters", "4", "--trace", "--trace-dir", str(trace_dir),
                          "--trace-interval", "2", "--continuous-trace-iterations", "2"] for node in (0, 1)])
    assert [code for code, _ in results] == [0, 0], [output[-3000:] for _, output in results]


def skew_node1(trace_dir: Path) -> None:
    """Node 1's files given a host identity of their own and a wall clock SKEW_US ahead."""
    hosts = {read_rank_file(path).rank: read_rank_file(path).header["host_id"] for path in iter_trace_files(trace_dir)}
    assert sorted(hosts) == [0, 1, 2, 3] and len(set(hosts.values())) == 1
    rewrite(trace_dir, host_of={r: host + ("-node1" if r in NODE1 else "") for r, host in hosts.items()},
            skew_ns={r: SKEW_US * 1000 for r in NODE1})


def fastest_messages_us(true) -> dict[int, tuple[float, float]]:
    """Per window, on the true clocks, the fastest P2P message node 0 -> node 1 and node 1 -> node 0
    (send start to receive end, µs): node 1's true offset lies in [-back, there] of any estimate
    that puts no receive before its send, so their sum is how well the messages pin it."""
    c, send, recv = true.trace.columns, true.p2p.send_rows, true.p2p.recv_rows
    latency = (c["end"][recv] - c["start"][send]) / 1e3
    to_node1 = np.isin(c["rank"][recv], NODE1) & ~np.isin(c["rank"][send], NODE1)
    to_node0 = np.isin(c["rank"][send], NODE1) & ~np.isin(c["rank"][recv], NODE1)
    window = c["window"][recv]
    return {w: (float(latency[to_node1 & (window == w)].min()), float(latency[to_node0 & (window == w)].min()))
            for w in np.unique(window).tolist()}


def test_two_real_nodes_one_with_a_skewed_clock(tmp_path):
    """Node 1 of a real two-node job (`two_node_job`) moved to a host of its own with a wall clock
    37 ms ahead. Aggregation fits one offset per host: node 0 keeps its raw clock, node 1 gets
    37 ms back within what the messages allow (no receive before its send), and within 0.5 ms in
    every window whose fastest messages each way pin the offset to under 1 ms (all of them but a
    slow spell's); nothing gets worse."""
    trace_dir = tmp_path / "trace"
    two_node_job(trace_dir)
    # As written: one real host, so nothing to align.
    true = aggregate(trace_dir, None, jobs=1)
    assert len(true.alignment.hosts) == 1 and true.alignment.before == true.alignment.after
    assert all(set(entry.offset_us.values()) == {0.0} for entry in true.alignment.ranks.values())
    fastest = fastest_messages_us(true)
    skew_node1(trace_dir)

    result = aggregate(trace_dir, tmp_path / "merged.json", jobs=1)
    alignment = result.alignment
    assert [h.ranks for h in alignment.hosts] == [[0, 1], NODE1], alignment.as_dict()["hosts"]
    reference, skewed = alignment.hosts
    assert reference.reference and set(reference.offset_us.values()) == {0.0}
    assert sorted(skewed.offset_us) == [0, 1] == sorted(fastest) and not skewed.kept_raw
    for window, offset in skewed.offset_us.items():
        there, back = fastest[window]
        error, context = offset - SKEW_US, (window, fastest, alignment.as_dict()["hosts"], alignment.notes)
        assert -back - 20 <= error <= there + 20, context
        if there + back < 1000:
            assert abs(error) < 500, context
    for rank, entry in alignment.ranks.items():
        assert entry.offset_us == (skewed if rank in NODE1 else reference).offset_us
    never_worse(alignment)
    assert alignment.before["causality_violations"] > 0 == alignment.after["causality_violations"]
    # Every event as far from its true time as its window allows: 0.5 ms, or its messages' bound.
    limit_us = max(500, *(max(pair) + 20 for pair in fastest.values()))
    for column in ("start", "end"):
        error = np.abs(result.trace.columns[column] - true.trace.columns[column])
        assert error.max() < limit_us * 1000, f"{column}: aligned {error.max() / 1e3:.0f} us from the true clock"


def test_synthetic_hosts_share_a_clock_and_are_aligned_as_hosts(tmp_path):
    """`synthesize --ranks-per-host`: consecutive ranks share a host identity and its clock error
    (given for one of its ranks), so alignment fits one clock per host and recovers the error."""
    spec = SyntheticRun(tp=2, pp=2, dp=4, iterations=4, ranks_per_host=4, offsets_ms={5: 21.0}, drift_ppm={9: 120.0})
    generate(spec, tmp_path)
    headers = {f.header["rank"]: f.header for f in map(read_rank_file, iter_trace_files(tmp_path))}
    assert {r: h["synthetic"]["offset_ms"] for r, h in headers.items() if h["synthetic"]["offset_ms"]} == \
        {4: 21.0, 5: 21.0, 6: 21.0, 7: 21.0}
    alignment = aggregate(tmp_path, None, jobs=1).alignment
    assert alignment.clock_domains == "host"
    assert [h.ranks for h in alignment.hosts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    offsets = [h.offset_us[0] for h in alignment.hosts]
    assert abs(offsets[1] - 21_000) < 500 and all(abs(o) < 500 for o in offsets[2:]), offsets
    assert alignment.hosts[2].drift_ppm[0] == pytest.approx(120.0, abs=40)
    never_worse(alignment)
