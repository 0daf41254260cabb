"""Two parts of one computation at once, on two CPUs: the second in a child forked from this
process. The online analysis process (a process of its own, single-threaded) runs the compute
analyzer beside the other three so. Only for work that mostly reads: each page either process
writes after the fork is copied first (parsing half the files in a child took twice as long)."""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
from typing import Any, Callable


def beside(here: Callable[[], Any], there: Callable[[], Any]) -> tuple[Any, Any]:
    """`here()` in this process and `there()` in a child forked from it at the same time: the child
    reads the parent's data in the pages they share (nothing is copied to it) and sends its answer
    back pickled, read once `here()` is done (at 4,096 ranks: the analyzers' findings, about
    1 MB). Should the child fail, `there()` runs here, so an error is raised as it would be
    without the child; the child never outlives this call. Only for a single-threaded process: a
    child forked while another thread holds a lock could block."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, and leave without running the parent's exit handlers
        status = 0
        try:
            os.close(read)
            try:
                payload = pickle.dumps(("answer", there()), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which runs it again
                payload = pickle.dumps(("failed", repr(exc)))
            with os.fdopen(write, "wb") as out:
                out.write(payload)
        except BaseException:  # noqa: BLE001
            status = 1
        finally:
            os._exit(status)
    os.close(write)
    received = None
    try:
        mine = here()
        with os.fdopen(read, "rb") as answer:
            read = -1
            received = pickle.loads(answer.read() or pickle.dumps(("failed", "no answer")))
    finally:
        if read >= 0:  # here() failed: the child's answer is not wanted
            os.close(read)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return mine, received[1] if received[0] == "answer" else there()
