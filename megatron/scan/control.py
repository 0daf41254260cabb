"""Capture on demand: a running job traces the next K iterations on every rank, from an iteration
all ranks agreed on, when asked (`python -m megatron.scan capture --job DIR --iterations K`), and
the metrics port's HTTP server that also takes such requests (`http_server`, `control_handler`).

The request is a file in the trace directory on rank 0's node (DIR/control/request-*.json; no
shared file system is needed). Rank 0 turns it into a decision (start iteration, K; or a new
window schedule) and every iteration broadcasts the latest decision over a gloo side group, with
an asynchronous broadcast issued after one iteration and waited for after the next, so the
training step never waits on it. The start is two iterations after rank 0 read the request, so
every rank knows it before the window begins. Rank 0 writes DIR/control/agreed-<id>.json with
what was decided, which the command waits for.

A request may also change online detection's thresholds (`online_detect_confirm`,
`online_detect_min_slowdown`): those matter on rank 0 only, where the detector runs, so rank 0
applies them at once (its `settings_listeners`) and nothing is broadcast for them."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron.scan.collectives import untraced
from megatron.scan.tracer import WindowSchedule

_FIELDS = 6  # decision id, start, iterations, interval, continuous, from_iteration


@dataclass
class CaptureSchedule:
    """The launch-time window schedule, changeable from an agreed iteration on, plus on-demand
    windows. Inside an on-demand window the regular schedule is suspended, so the window is
    exactly the requested iterations."""

    base: WindowSchedule
    captures: list[tuple[int, int]] = field(default_factory=list)  # (first iteration, count)
    changes: list[tuple[int, WindowSchedule]] = field(default_factory=list)  # (from iteration, schedule)

    def _capture(self, iteration: int) -> tuple[int, int] | None:
        for start, count in self.captures:
            if start <= iteration < start + count:
                return start, count
        return None

    def _base(self, iteration: int) -> WindowSchedule:
        schedule = self.base
        for start, changed in self.changes:
            if iteration >= start:
                schedule = changed
        return schedule

    def is_traced(self, iteration: int) -> bool:
        return self._capture(iteration) is not None or self._base(iteration).is_traced(iteration)

    def is_window_end(self, iteration: int) -> bool:
        capture = self._capture(iteration)
        if capture is not None:
            return iteration == capture[0] + capture[1] - 1
        base = self._base(iteration)
        if self._capture(iteration + 1) is not None:
            return base.is_traced(iteration)  # a regular window is closed where a capture begins
        return base.is_window_end(iteration)


def request_directory(trace_dir: str | os.PathLike) -> Path:
    return Path(trace_dir) / "control"


def write_request(trace_dir: str | os.PathLike, request: dict) -> Path:
    """Leaves a request for the job writing `trace_dir` (rank 0 picks it up); returns its path."""
    directory = request_directory(trace_dir)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"request-{time.time_ns()}-{os.getpid()}.json"
    temporary = directory / f".{name}.tmp"
    temporary.write_text(json.dumps(request))
    os.replace(temporary, directory / name)
    return directory / name


class ControlExchange:
    """One per rank. `after_iteration(i)` applies what rank 0 decided and (rank 0) reads new
    requests; all ranks call it after every iteration."""

    def __init__(self, trace_dir: str | os.PathLike, rank: int, schedule: CaptureSchedule, group=None) -> None:
        import torch

        self.directory = request_directory(trace_dir)
        self.rank, self.schedule, self.group = rank, schedule, group
        self.latest = torch.zeros(_FIELDS, dtype=torch.int64)  # rank 0's last decision
        self.buffer = torch.zeros(_FIELDS, dtype=torch.int64)
        self.pending = None
        self.applied = 0  # id of the last decision applied here
        self.next_id = 1
        # Rank 0: callables taking {"confirm": int, "min_slowdown": float} (what changed), each
        # returning the settings now in force; none where the job runs no online detection.
        self.settings_listeners: list = []

    def listen_for_settings(self, listener) -> None:
        """Rank 0: `listener` ({"confirm": int, "min_slowdown": float} -> the settings in force) is
        called with each threshold change asked of the running job."""
        self.settings_listeners.append(listener)

    def after_iteration(self, iteration: int) -> None:
        import torch.distributed as dist

        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self._apply(self.buffer.tolist())
        if self.rank == 0:
            self._read_requests(iteration)
            self.buffer.copy_(self.latest)
        if self.group is not None:
            self.pending = untraced(dist.broadcast)(self.buffer, src=0, group=self.group, async_op=True)
        else:  # a single process: no exchange, decisions apply at once
            self._apply(self.buffer.tolist())

    def close(self, timeout: float | None = None) -> None:
        """Waits for the last broadcast: at the end of training, where every rank issued it. With
        `timeout` (a process exiting, its peers perhaps gone) it gives up after that long."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if timeout is None:
            pending.wait()
            return
        import datetime

        try:
            pending.wait(datetime.timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - a peer already gone: nothing left to agree on
            pass

    def _apply(self, values: list[int]) -> None:
        decision, start, count, interval, continuous, from_iteration = values
        if decision <= self.applied:
            return
        self.applied = decision
        if count > 0:
            self.schedule.captures.append((start, count))
        if interval > 0:
            self.schedule.changes.append((from_iteration, WindowSchedule(interval, continuous)))

    def _read_requests(self, iteration: int) -> None:
        try:
            names = sorted(p for p in os.listdir(self.directory) if p.startswith("request-") and p.endswith(".json"))
        except OSError:
            return
        if not names:
            return
        path = self.directory / names[0]  # one decision per iteration; the others wait their turn
        try:
            request = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            self._answer(path, {"error": f"unreadable request: {exc}"})
            return
        problem, settings = self._settings(request)
        count = int(request.get("iterations") or 0)
        interval = int(request.get("interval") or 0)
        continuous = int(request.get("continuous") or (1 if interval else 0))
        if problem is None and (count < 0 or interval < 0 or (interval and not 1 <= continuous <= interval)
                                or not (count or interval or settings)):
            problem = ("a request needs iterations >= 1, or an interval >= 1 with 1 <= continuous <= interval, "
                       "or online detection settings")
        if problem is not None:
            self._answer(path, {"error": problem, "request": request})
            return
        answer = {"read_at_iteration": iteration}
        if settings:
            for listener in self.settings_listeners:
                answer["online_detect"] = listener(settings)
        if count or interval:
            # Two iterations on: the broadcast issued now is waited for after the next iteration.
            start = max(iteration + 2, max((s + c for s, c in self.schedule.captures), default=0))
            decision = self.next_id
            self.next_id += 1
            self.latest.copy_(self.latest.new_tensor([decision, start, count, interval, continuous, start]))
            answer.update(id=decision, start=start, iterations=count)
            if interval:
                answer.update(interval=interval, continuous=continuous)
        self._answer(path, answer)

    def _settings(self, request: dict) -> tuple[str | None, dict]:
        """(what is wrong with the request's online detection settings or None, the settings)."""
        settings = {}
        try:
            if request.get("online_detect_confirm") is not None:
                settings["confirm"] = int(request["online_detect_confirm"])
                if settings["confirm"] < 1:
                    return "online_detect_confirm must be >= 1 (1 reports every finding at once)", {}
            if request.get("online_detect_min_slowdown") is not None:
                settings["min_slowdown"] = float(request["online_detect_min_slowdown"])
                if not settings["min_slowdown"] >= 1.0:
                    return "online_detect_min_slowdown must be >= 1.0 (a factor over the rank's peers)", {}
        except (TypeError, ValueError) as exc:
            return f"online detection settings must be numbers: {exc}", {}
        if settings and not self.settings_listeners:
            return "this job runs no online detection (start it with --online-detect)", {}
        return None, settings

    def _answer(self, path: Path, answer: dict) -> None:
        agreed = path.with_name(path.name.replace("request-", "agreed-"))
        temporary = agreed.with_name(f".{agreed.name}.tmp")
        temporary.write_text(json.dumps(answer))
        os.replace(temporary, agreed)
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------- requests over the metrics port


def read_control_token(path: str | os.PathLike) -> str:
    """The token in --metrics-control-token-file; ValueError saying what to change."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"--metrics-control-token-file: cannot read it: {exc}") from None
    if len(token) < 16:
        raise ValueError("--metrics-control-token-file: the token must have at least 16 characters")
    return token


def control_handler(directory, token: str | None, traced: bool):
    """Rank 0's POST /capture: the same request as `python -m megatron.scan capture`, left in
    `directory`'s control folder; GET /capture/<answer> then returns rank 0's answer (404 until it
    is made). Without a token every control request is refused (403): the port is read-only."""
    import hmac

    def control(body: dict | None, authorization: str, answer: str | None = None) -> tuple[int, dict]:
        if token is None:
            return 403, {"error": "this metrics port is read-only: start the job with --metrics-control-token-file "
                                  "to accept capture requests"}
        if not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
            return 401, {"error": "missing or wrong token (Authorization: Bearer TOKEN)"}
        if answer is not None:
            if not (answer.startswith("agreed-") and answer.endswith(".json") and "/" not in answer):
                return 400, {"error": "no such answer"}
            try:
                return 200, json.loads((request_directory(directory) / answer).read_text())
            except (OSError, ValueError):
                return 404, {"error": "not answered yet"}
        if not traced:
            return 409, {"error": "the job is not traced: captures need --trace"}
        try:
            request = {"iterations": int(body.get("iterations") or 0), "interval": int(body.get("trace_interval") or 0),
                       "continuous": int(body.get("continuous_trace_iterations") or 0),
                       **{key: body[key] for key in ("online_detect_confirm", "online_detect_min_slowdown")
                          if body.get(key) is not None}}
        except (AttributeError, TypeError, ValueError) as exc:
            return 400, {"error": f"a capture request is a JSON object of numbers: {exc}"}
        path = write_request(directory, request)
        return 202, {"request": path.name, "answer": path.name.replace("request-", "agreed-")}

    return control


def not_rank_zero(body: dict | None, authorization: str, answer: str | None = None) -> tuple[int, dict]:
    return 409, {"error": "send control requests to rank 0's metrics port (DIR/metrics-targets-rank0.json)"}


def http_server(registry, port: int, addr: str = "0.0.0.0", control=None):
    """A threaded HTTP server on (addr, port) in a daemon thread: GET /metrics from `registry`;
    with `control` (a callable taking the request's JSON body, the Authorization header and, for
    GET /capture/<answer>, the answer's name, returning (HTTP status, JSON answer)) also POST
    /capture. Without it the port is read-only (403)."""
    import threading
    from http.server import ThreadingHTTPServer

    from prometheus_client.exposition import MetricsHandler

    class Handler(MetricsHandler.factory(registry)):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if not self.path.startswith("/capture/"):
                return super().do_GET()
            if control is None:
                return self._answer(403, {"error": "this metrics port is read-only"})
            status, answer = control(None, self.headers.get("Authorization", ""), self.path.split("/")[-1])
            self._answer(status, answer)

        def do_POST(self) -> None:  # noqa: N802
            if self.path.split("?")[0] != "/capture":
                return self._answer(404, {"error": "POST /capture is the only control request"})
            if control is None:
                return self._answer(403, {"error": "this metrics port is read-only"})
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return self._answer(400, {"error": "the body must be JSON, e.g. {\"iterations\": 3}"})
            status, answer = control(body, self.headers.get("Authorization", ""))
            self._answer(status, answer)

        def _answer(self, status: int, answer: dict) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # no access log on the training job's stderr
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="megascan-metrics", daemon=True).start()
    return server
