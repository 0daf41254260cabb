"""The serving rank's glue: validated client messages become jobs, run one at a time on the
thread that owns the model, and their results go back to the client that asked."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from megatron.scope.capture import CAPTURE_KINDS
from megatron.scope.codec import BIN_CHOICES, REDUCE_CHOICES
from megatron.scope.engine import Generator, PromptError, prompt_format
from megatron.scope.perturb import KINDS, TYPES
from megatron.scope.protocol import MAX_NEW_TOKENS, MAX_PROMPTS, ProtocolError, validate
from megatron.scope.server import Job, ScopeServer, ServerConfig

logger = logging.getLogger(__name__)
IDLE_HEARTBEAT_S = 30.0  # keeps follower ranks' broadcast wait far inside the process-group timeout


class ScopeService:
    """Owns the server; `process_pending` runs queued jobs on the calling (model) thread."""

    def __init__(self, generator: Generator, config: ServerConfig, mode: str = "generate") -> None:
        self.generator = generator
        self.info = generator.info
        self.mode = mode
        self.jobs: queue.Queue[tuple[Job, Any]] = queue.Queue(maxsize=16)
        self.stop_generation = threading.Event()
        self.shutdown = threading.Event()
        self.server = ScopeServer(config, self._on_message, self._hello)
        self.on_train: Callable[[Job, dict], None] | None = None  # set by the training plugin
        self.train_state: Callable[[], dict] | None = None
        self._last_broadcast = time.monotonic()
        self.handlers: dict[str, Callable[[Job, Any], None]] = {"generate": self._generate, "pca": self._pca}

    def start(self) -> str:
        return self.server.start()

    def close(self) -> None:
        self.shutdown.set()
        self.server.stop()

    def _hello(self) -> dict[str, Any]:
        hello = {"mode": self.mode, "model": self.info.as_message(), "capture_kinds": list(CAPTURE_KINDS),
                 "bins": list(BIN_CHOICES), "reduce": list(REDUCE_CHOICES), "perturbation_kinds": list(KINDS),
                 "perturbation_types": list(TYPES), "max_prompts": MAX_PROMPTS, "max_new_tokens": MAX_NEW_TOKENS}
        prompts = prompt_format(self.generator.tokenizer, self.generator.vocab_size)
        if prompts is not None:
            hello["prompt_format"] = prompts  # not text: say so before the first request
        if self.train_state is not None:
            hello["training"] = self.train_state()
        return hello

    # --- server thread ------------------------------------------------------------------
    def _on_message(self, job: Job) -> None:
        request = validate(job.data, self.info)
        if job.type == "stop":
            self.stop_generation.set()
        elif job.type == "ping":
            self.server.send(job.client, "json", {"type": "pong", "id": job.data.get("id")})
        elif job.type == "train":
            if self.on_train is None:
                raise ProtocolError("this server is not attached to a training run", code="not_training")
            self.on_train(job, request)
        else:
            try:
                self.jobs.put_nowait((job, request))
            except queue.Full:
                raise ProtocolError("the server is busy; wait for the running requests", code="busy") from None

    # --- model thread -------------------------------------------------------------------
    def process_pending(self, timeout: float = 0.5) -> bool:
        """Run at most one queued job; returns whether one ran."""
        try:
            job, request = self.jobs.get(timeout=timeout)
        except queue.Empty:
            if self.generator.coordinator.distributed and time.monotonic() - self._last_broadcast > IDLE_HEARTBEAT_S:
                self.generator.coordinator.send("idle")
                self._last_broadcast = time.monotonic()
            return False
        try:
            self.handlers[job.type](job, request)
        except (PromptError, ProtocolError) as exc:  # the client's to fix: no traceback in the server log
            self.server.send(job.client, "json", {"type": "error", "code": exc.code, "message": f"{job.type}: {exc}"})
        except Exception as exc:  # a failed request must not take the model server down
            logger.exception("MegaScope %s request failed", job.type)
            code = getattr(exc, "code", "failed")
            self.server.send(job.client, "json", {"type": "error", "code": code, "message": f"{job.type}: {exc}"})
        self._last_broadcast = time.monotonic()
        return True

    def serve_forever(self) -> None:
        while not self.shutdown.is_set():
            self.process_pending(0.5)

    def _generate(self, job: Job, request) -> None:
        self.stop_generation.clear()

        def emit(kind: str, payload: Any, droppable: bool) -> None:
            self.server.send(job.client, kind, payload, droppable)

        summary = self.generator.generate(request, emit, self.stop_generation.is_set)
        summary["dropped"] = self.server.dropped(job.client)
        self.server.send(job.client, "json", summary)

    def _pca(self, job: Job, request: dict) -> None:
        try:
            result, labels = self.generator.pca(request["layer"])
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        self.server.send(job.client, "json", {
            "type": "pca", "layer": request["layer"], "points": result.coords.round(5).tolist(),
            "labels": labels, "explained": result.explained_variance_ratio.round(5).tolist(),
        })
