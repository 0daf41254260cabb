"""Runs multi-rank shm_tensor_rdma scenarios as real processes with hard timeouts.

Each rank runs strdma_worker.py, rendezvous goes through a TCPStore hosted by the test
process, and every rank writes its check results as JSON. A rank that hangs is killed when the
timeout passes, and the test fails with every rank's log, so a bug never hangs pytest.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from launch import ROOT, env
from megatron.shm_tensor_rdma import Endpoint, EndpointConfig

WORKER = Path(__file__).with_name("strdma_worker.py")


@dataclass
class Run:
    job_id: str
    returncodes: list[int | None]
    logs: list[str]
    results: list[dict | None]
    pids: list[int] = field(default_factory=list)

    def describe(self) -> str:
        parts = []
        for rank, (rc, log) in enumerate(zip(self.returncodes, self.logs)):
            parts.append(f"--- rank {rank} (exit {rc}) ---\n{log[-4000:]}")
        return "\n".join(parts)

    def check(self, rank: int, name: str) -> dict:
        """The named check of one rank; fails with the logs when it is missing or failed."""
        result = self.results[rank]
        assert result is not None, f"rank {rank} wrote no results\n{self.describe()}"
        assert name in result, f"rank {rank} did not run check {name!r}\n{self.describe()}"
        entry = result[name]
        assert entry["ok"], f"rank {rank} check {name!r} failed: {entry['detail']}\n{self.describe()}"
        return entry


def start_ranks(scenario: str, world_size: int, tmp_path: Path, *, transports: str = "shm,tcp",
                extra: list[str] | None = None, addresses: list[str] | None = None,
                prefixes: list[list[str]] | None = None, job_id: str | None = None):
    """Starts the ranks; returns (processes, store, job_id, out_dir). Use finish_ranks()."""
    job_id = job_id or f"t-{scenario}-{uuid.uuid4().hex[:10]}"
    out = tmp_path / job_id
    out.mkdir(parents=True)
    store = None
    rendezvous: list[str]
    if addresses is None:
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, True, wait_for_workers=False)
        rendezvous = ["--store-port", str(store.port)]
    else:
        rendezvous = ["--addresses", ",".join(addresses)]
    procs = []
    for rank in range(world_size):
        command = [*(prefixes[rank] if prefixes else []), sys.executable, str(WORKER), scenario,
                   "--rank", str(rank), "--world-size", str(world_size), "--job-id", job_id,
                   "--out", str(out), "--transports", transports, *rendezvous, *(extra or [])]
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        log.close()
    return procs, store, job_id, out


def finish_ranks(procs, store, job_id: str, out: Path, timeout: float) -> Run:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    hung = [p for p in procs if p.poll() is None]
    for proc in hung:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    logs = [(out / f"rank{r}.log").read_text(errors="replace") for r in range(len(procs))]
    results = []
    for rank in range(len(procs)):
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    run = Run(job_id, [p.returncode for p in procs], logs, results, [p.pid for p in procs])
    del store
    if hung:
        raise AssertionError(f"ranks {[procs.index(p) for p in hung]} hung for {timeout} s and were killed\n"
                             f"{run.describe()}")
    return run


def run_ranks(scenario: str, world_size: int, tmp_path: Path, *, timeout: float = 60, **kwargs) -> Run:
    procs, store, job_id, out = start_ranks(scenario, world_size, tmp_path, **kwargs)
    return finish_ranks(procs, store, job_id, out, timeout)


def make_pair(job_id: str | None = None, store=None, config: EndpointConfig | None = None,
              per_rank_configs: list[EndpointConfig] | None = None):
    """Ranks 0 and 1 of one job, built concurrently (each constructor waits for the other)."""
    job_id = job_id or f"api-{uuid.uuid4().hex[:8]}"
    store = store or dist.HashStore()
    endpoints: list = [None, None]
    errors: list = []

    def build(rank: int) -> None:
        try:
            rank_config = per_rank_configs[rank] if per_rank_configs else config
            endpoints[rank] = Endpoint.from_store(store, job_id, rank, 2, host="127.0.0.1", config=rank_config)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return endpoints


def shm_names_of(job_id: str) -> list[str]:
    """Entries in /dev/shm that belong to this job (segment names carry the job id's hash)."""
    from megatron.shm_tensor_rdma import _C

    marker = _C.shm_segment_name(job_id, 0).split(".r0.")[0].lstrip("/")
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(marker))
