"""Trace files gathered to rank 0's node without a shared file system.

Each node writes its ranks' trace files to its own --trace-dir. At start-up the ranks find out
which of them write where rank 0 does (rank 0 leaves a marker file named after the run in its
directory; a rank that sees it in its own directory shares rank 0's file system). Every other
rank then streams its trace file to rank 0 over a gloo side group, in a background thread:

* the sender reads what its trace writer appended (whole lines only) from its own file, which is
  the backlog: a slow link or a busy rank 0 never grows memory, whatever the backlog on disk;
* it sends at most CHUNK bytes per message and at most `rate` bytes per second (token bucket),
  so memory is one chunk per sender and bandwidth is bounded per rank;
* rank 0's receiver appends each rank's bytes to the file of the same name in its own directory
  (whole lines only, fsync'd like the writer's appends), so `scripts/aggregate.py -b DIR` and
  online detection on rank 0's node see the whole job; each node keeps its own files too.

The training step never waits on any of this: the sender starts once the first window is on disk
(the header is final by then) and only reads files; the gloo side group is used by these threads
alone. At the end the sender sends what is left and an end message; rank 0 waits for every
sender's end (bounded by `close`'s timeout) before the run ends."""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from pathlib import Path

from megatron.scan.hang import rank_ranges

CHUNK = 1 << 20  # bytes per message: a sender's and the receiver's buffer
DEFAULT_RATE_MB = 20.0  # MB/s per sending rank
_META, _DATA = 11, 12  # gloo tags of the two halves of a message
_START, _APPEND, _END = 1, 2, 3


def _marker(directory: Path, run_id: str) -> Path:
    return directory / f".megascan-rank0-{run_id}"


class TraceSender:
    """A rank writing where rank 0 cannot read: streams `writer`'s file to rank 0."""

    def __init__(self, writer, group, rate_bytes: float, poll_s: float = 0.25) -> None:
        self.writer, self.group, self.rate, self.poll_s = writer, group, rate_bytes, poll_s
        self.sent = 0  # bytes of the file sent so far
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self._allowance, self._last = float(CHUNK), time.monotonic()
        self.thread = threading.Thread(target=self._run, name="megascan-gather-send", daemon=True)
        self.thread.start()

    def _send(self, kind: int, name: str, data: bytes) -> None:
        import torch
        import torch.distributed as dist

        from megatron.scan.collectives import untraced

        send = untraced(dist.send)
        payload = name.encode() + data
        meta = torch.tensor([kind, len(name.encode()), len(payload)], dtype=torch.int64)
        send(meta, dst=0, group=self.group, tag=_META)
        if payload:
            send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0, group=self.group, tag=_DATA)

    def _throttle(self, size: int) -> None:
        now = time.monotonic()
        self._allowance = min(float(CHUNK), self._allowance + (now - self._last) * self.rate)
        self._last = now
        if self._allowance < size:
            time.sleep((size - self._allowance) / self.rate)
            self._last = time.monotonic()
            self._allowance = 0.0
        else:
            self._allowance -= size

    def _pump(self, f, name: str, final: bool) -> None:
        """Sends what the file `f` holds beyond `sent`, whole lines only (all of it when `final`)."""
        while True:
            f.seek(self.sent)
            data = f.read(CHUNK)
            if not data:
                return
            if len(data) == CHUNK or not final:
                cut = data.rfind(b"\n") + 1
                if cut == 0 and len(data) < CHUNK:
                    return  # a line still being written
                data = data[:cut] if cut else data  # a line longer than CHUNK goes in pieces
            self._throttle(len(data))
            self._send(_START if self.sent == 0 else _APPEND, name, data)
            self.sent += len(data)

    def _run(self) -> None:
        try:
            # The header is final once a window was submitted (or the writer closed): a program's
            # layout may rename the file before that.
            while not (self.writer.final or self.stopping.is_set()):
                time.sleep(self.poll_s)
            path = self.writer.path
            with open(path, "rb") as f:
                while not self.stopping.wait(self.poll_s):
                    self._pump(f, path.name, final=False)
                self._pump(f, path.name, final=True)
            self._send(_END, path.name, b"")
        except BaseException as exc:  # noqa: BLE001 - gathering must never stop training
            self.error = exc

    def close(self, timeout: float) -> None:
        """After the writer closed: sends the rest and the end message."""
        self.stopping.set()
        self.thread.join(timeout)
        if self.thread.is_alive() or self.error is not None:
            why = "timed out" if self.thread.is_alive() else repr(self.error)
            print(f"[megascan] warning: gathering {self.writer.path.name} to rank 0 stopped after "
                  f"{self.sent} bytes ({why}); the file is complete on this node", file=sys.stderr, flush=True)


class TraceReceiver:
    """Rank 0: takes the senders' streams into `directory` until every one has ended."""

    def __init__(self, directory: Path, group, senders: list[int], run_id: str) -> None:
        self.directory, self.group, self.pending, self.run_id = directory, group, set(senders), run_id
        self.files: dict[int, list] = {}  # sender -> [path, fd or None (refused), unfinished line]
        self.bytes_received = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="megascan-gather-receive", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import torch
        import torch.distributed as dist

        from megatron.scan.collectives import untraced

        recv = untraced(dist.recv)
        meta = torch.zeros(3, dtype=torch.int64)
        try:
            while self.pending:
                sender = recv(meta, src=None, group=self.group, tag=_META)
                kind, name_length, size = (int(v) for v in meta.tolist())
                payload = torch.empty(size, dtype=torch.uint8)
                if size:
                    recv(payload, src=sender, group=self.group, tag=_DATA)
                raw = payload.numpy().tobytes()
                self._take(sender, kind, raw[:name_length].decode(), raw[name_length:])
        except BaseException as exc:  # noqa: BLE001 - a sender gone: what arrived stays
            self.error = exc

    def _take(self, sender: int, kind: int, name: str, data: bytes) -> None:
        if kind == _END:
            self.pending.discard(sender)
            state = self.files.pop(sender, None)
            if state is not None and state[1] is not None:
                os.close(state[1])
            return
        if "/" in name or not name.startswith("benchmark-data-"):
            raise ValueError(f"rank {sender} sent a file name that is no trace file: {name!r}")
        state = self.files.get(sender)
        if kind == _START or state is None:
            path = self.directory / name
            if _run_of(path) == self.run_id:
                # The rank writes here itself after all (a shared file system that hid rank 0's
                # marker): its own file is the one to keep.
                print(f"[megascan] warning: not gathering {name} from rank {sender}: the file is already in "
                      f"{self.directory}", file=sys.stderr, flush=True)
                self.files[sender] = [path, None, b""]
                return
            path.unlink(missing_ok=True)  # an earlier run's file of that name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o644)
            state = self.files[sender] = [path, fd, b""]
        if state[1] is None:
            return
        whole = state[2] + data
        cut = whole.rfind(b"\n") + 1
        state[2] = whole[cut:]
        view = memoryview(whole)[:cut]
        while view:
            view = view[os.write(state[1], view):]
        if cut:
            os.fsync(state[1])
        self.bytes_received += len(data)

    def close(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.pending:
            why = "timed out" if self.thread.is_alive() else repr(self.error)
            print(f"[megascan] warning: trace files of ranks {sorted(self.pending)} were not completely gathered "
                  f"to {self.directory} ({why}); they are complete on their own nodes", file=sys.stderr, flush=True)


class Gathering:
    """One per rank: finds who writes where rank 0 does, and streams the others' trace files to
    rank 0. Every rank constructs it alike (it creates a process group)."""

    def __init__(self, writer, run_id: str, rank: int, world_size: int, *, rate_mb: float = DEFAULT_RATE_MB) -> None:
        import torch.distributed as dist

        from megatron.scan.collectives import untraced

        self.sender: TraceSender | None = None
        self.receiver: TraceReceiver | None = None
        self.senders: list[int] = []
        directory = writer.path.parent
        if world_size <= 1:
            return
        # Long enough for rank 0 to wait out a slow sender's backlog at the end.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=2))
        if rank == 0:
            _marker(directory, run_id).write_text(str(os.getpid()))
        untraced(dist.barrier)(group=self.group)
        flags = [None] * world_size
        untraced(dist.all_gather_object)(flags, _marker(directory, run_id).exists(), group=self.group)
        self.senders = [r for r, shared in enumerate(flags) if not shared]
        if rank == 0:
            _marker(directory, run_id).unlink(missing_ok=True)
            if self.senders:
                print(f"[megascan] gathering the trace files of ranks {rank_ranges(self.senders)} (no shared file system "
                      f"with rank 0) into {directory}, at most {rate_mb:g} MB/s per rank", file=sys.stderr, flush=True)
                self.receiver = TraceReceiver(directory, self.group, self.senders, run_id)
        elif rank in self.senders:
            self.sender = TraceSender(writer, self.group, rate_mb * 1e6)

    def close(self, timeout: float = 600.0) -> None:
        """After the trace writer closed: the rest of this rank's file goes (a sender), or the
        others' files are complete (rank 0)."""
        if self.sender is not None:
            self.sender.close(timeout)
            self.sender = None
        if self.receiver is not None:
            self.receiver.close(timeout)
            self.receiver = None


def _run_of(path: Path) -> str | None:
    """The run id in a trace file's header, None where there is no readable file."""
    import json

    try:
        with open(path, "rb") as f:
            return json.loads(f.readline()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None

