"""Hang merge and crash capture without a distributed job: table-driven dumps with the expected
culprits next to each case, and single processes that raise or die of a fatal signal."""
from __future__ import annotations

import json
import textwrap

import pytest

from launch import python
from megatron.scan.hang import diagnose, format_html, format_text, merge_stacks, rank_ranges


def group(name, ranks, in_flight=None, last=None):
    return {"name": name, "ranks": ranks, "desc": "", "issued": 0,
            "in_flight": None if in_flight is None else {"op": "all_reduce", "seq": in_flight, "waiting_s": 5.0},
            "last_completed": None if last is None else {"op": "all_reduce", "seq": last}}


def dump(rank, groups, p2p=(), world=4):
    return {"type": "hang-dump", "rank": rank, "world_size": world, "timeout_s": 10, "iteration": 3,
            "stalled_s": 11, "last_progress": "x", "host": "h", "pid": 1, "groups": groups,
            "p2p_in_flight": [{"kind": k, "peer": p, "open_s": 5.0} for k, p in p2p],
            "threads": [{"name": "MainThread", "main": True, "frames": [
                {"file": "train.py", "line": 1, "function": "main", "code": ""},
                {"file": "train.py", "line": 2 + rank % 2, "function": f"step{rank % 2}", "code": ""}]}]}


CASES = {
    # one rank never joins the world all-reduce
    "straggler": ({r: dump(r, [group("0", [0, 1, 2, 3], None if r == 2 else 7, 6)]) for r in range(4)}, [2]),
    # rank 3 waits in recv from 1, rank 1 waits in a TP all-reduce with 0, rank 0 sits outside
    "chain": ({0: dump(0, [group("tp", [0, 1], None, 4)]), 1: dump(1, [group("tp", [0, 1], 5, 4)]),
               2: dump(2, []), 3: dump(3, [], p2p=[("recv", 1)])}, [0]),
    # 0 receives from 1 while 1 receives from 0: a deadlock, both named
    "cycle": ({0: dump(0, [], p2p=[("recv", 1)], world=2), 1: dump(1, [], p2p=[("recv", 0)], world=2)}, [0, 1]),
    # rank 3 left no dump at all (dead host): the blocked ranks still point at it
    "dead rank": ({r: dump(r, [group("0", [0, 1, 2, 3], 9, 8)]) for r in range(3)}, [3]),
}


@pytest.mark.parametrize("case", CASES)
def test_culprits(case, tmp_path):
    dumps, expected = CASES[case]
    for rank, payload in dumps.items():
        (tmp_path / f"hang-rank{rank}.json").write_text(json.dumps(payload))
    report = diagnose(tmp_path)
    assert report.culprits == expected
    text = format_text(report)
    assert f"culprit ranks: {rank_ranges(expected)} " in text
    assert "<svg" in format_html(report)


def test_rank_ranges():
    assert rank_ranges([5, 0, 1, 2, 3]) == "0-3,5"
    assert rank_ranges([7]) == "7" and rank_ranges([]) == "-"


def test_all_threads_leaves_out_every_megascan_thread():
    """With all threads, the user's own threads are merged and MegaScan's (whatever their job) are not."""
    frames = [{"file": "t.py", "line": 1, "function": "wait", "code": ""}]
    threads = [{"name": name, "main": name == "MainThread", "frames": frames}
               for name in ("MainThread", "data-loader", "megascan-watchdog", "megascan-gather-receive",
                            "megascan-online-detect")]
    tree = merge_stacks({0: {"threads": threads}, 1: {"threads": threads[:2]}}, all_threads=True)
    assert sorted(child.function for child in tree.children.values()) == ["[thread MainThread]",
                                                                           "[thread data-loader]"]
    assert all(child.ranks == {0, 1} for child in tree.children.values())


def test_no_dumps_is_a_clear_error(tmp_path):
    proc = python(["-m", "megatron.scan", "hang", str(tmp_path)], timeout=60)
    assert proc.returncode == 2 and "no hang-rank*.json" in proc.stderr


CRASHER = textwrap.dedent("""
    import sys
    from megatron.scan.watchdog import CrashCapture, process_identity
    CrashCapture(sys.argv[1], process_identity()).install()
    def compute_loss():
        if sys.argv[2] == "raise":
            raise ValueError("loss is nan at iteration 7")
        import faulthandler
        faulthandler._sigsegv()
    compute_loss()
""")


def test_crash_capture_exception_and_fatal_signal(tmp_path):
    script = tmp_path / "crasher.py"
    script.write_text(CRASHER)
    raised = python([str(script), str(tmp_path), "raise"], extra_env={"RANK": "2", "WORLD_SIZE": "4"}, timeout=120)
    assert raised.returncode == 1 and "loss is nan" in raised.stderr  # the usual traceback still prints
    crash = json.loads((tmp_path / "crash-rank2.json").read_text())
    assert crash["rank"] == 2 and crash["exception"] == "ValueError"
    assert crash["frames"][-1]["function"] == "compute_loss"
    assert not (tmp_path / "crash-rank2-fatal.txt").exists()  # nothing fatal happened: no empty file left

    died = python([str(script), str(tmp_path), "segv"], extra_env={"RANK": "1", "WORLD_SIZE": "4"}, timeout=120)
    assert died.returncode != 0
    fatal = (tmp_path / "crash-rank1-fatal.txt").read_text()
    assert "rank 1" in fatal and "Segmentation fault" in fatal and "compute_loss" in fatal
    proc = python(["-m", "megatron.scan", "hang", str(tmp_path)], timeout=60)
    assert proc.returncode == 0
    assert "crashed: rank 1" in proc.stdout and "crashed: rank 2: ValueError: loss is nan" in proc.stdout
