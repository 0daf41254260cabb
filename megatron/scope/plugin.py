"""MegaScope as a trainer plugin. `--training-ws-port PORT` streams a chosen sample's internals,
the loss and per-layer gradient norms while training runs, and lets the UI start, pause and
step it (and perturb the training forward); `--enable-ws-server` keeps serving generation on
the trained model when training ends."""
from __future__ import annotations

import argparse
import collections
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.app.config import ConfigError
from megatron.app.plugins import Plugin, register_plugin

DEFAULT_SAMPLE = "Return the number of items in the"


DEFAULT_PORT = 8765


@dataclass(frozen=True, slots=True)
class ScopeConfig:
    """MegaScope's section, from its flags."""

    port: int  # --training-ws-port, or the default port of --enable-ws-server alone
    during_training: bool  # views while training (--training-ws-port)
    serve_after: bool  # generation on the trained model afterwards (--enable-ws-server)
    host: str
    token: str | None
    start_paused: bool
    sample: str
    observe_every: int


@register_plugin
class ScopePlugin(Plugin):
    name = "scope"
    flag = "--training-ws-port"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("MegaScope (live model internals in the browser)")
        g.add_argument("--training-ws-port", type=int, default=None,
                       help="serve the MegaScope app on this port while training (0 = any free port)")
        g.add_argument("--enable-ws-server", action="store_true",
                       help="serve MegaScope (generation) on the trained model after training; "
                            "with --training-ws-port also during training")
        g.add_argument("--ws-host", default="127.0.0.1", help="address the MegaScope server binds")
        g.add_argument("--ws-token", default=None, help="access token (default: random per run)")
        g.add_argument("--ws-start-paused", action="store_true", help="wait for 'start' in the UI before training")
        g.add_argument("--ws-observe-every", type=int, default=1, help="stream the sample every N iterations")
        g.add_argument("--ws-sample", default=DEFAULT_SAMPLE, help="text whose internals are streamed")

    def enabled(self, args: argparse.Namespace) -> bool:
        return args.training_ws_port is not None or bool(args.enable_ws_server)

    def configure(self, cfg) -> None:
        args = cfg.args
        self.config = ScopeConfig(
            port=args.training_ws_port if args.training_ws_port is not None else DEFAULT_PORT,
            during_training=args.training_ws_port is not None, serve_after=bool(args.enable_ws_server),
            host=args.ws_host, token=args.ws_token, start_paused=bool(args.ws_start_paused),
            sample=args.ws_sample, observe_every=args.ws_observe_every)
        port = self.config.port
        if not 0 <= port < 65536:
            raise ConfigError(f"--training-ws-port {port} is not a TCP port (0..65535)")
        if cfg.num_chunks > 1:
            raise ConfigError("MegaScope does not support virtual pipeline stages yet; "
                              "drop --num-layers-per-virtual-pipeline-stage or the MegaScope flags")
        if args.ws_observe_every < 1:
            raise ConfigError("--ws-observe-every must be >= 1")

    # --- setup ------------------------------------------------------------------------
    def setup(self, ctx) -> None:
        from megatron.app.data import tokenizer_from_config
        from megatron.scope.engine import Coordinator, Generator
        from megatron.scope.loading import info_for
        from megatron.scope.runner import ModelRunner

        cfg, config = ctx.cfg, self.config
        self.tokenizer = tokenizer_from_config(cfg.data)
        p = cfg.parallel
        info = info_for(cfg.model, p.tensor_model_parallel_size, p.pipeline_model_parallel_size, "training")
        self.runner = ModelRunner(ctx.chunks, info, ctx.backend.device)
        self.coordinator = Coordinator(self.runner)
        self.is_server = ctx.rank == 0
        self.during_training = config.during_training
        self.lock = threading.Lock()
        self.paused = config.start_paused
        self.steps_allowed = 0
        self.sample = config.sample
        self.observe_every = config.observe_every
        self.perturbations: list = []
        self.plan: dict[str, Any] = {}
        self.active_perturbations = None
        self.layer_norms: list[float] = []
        self.history: collections.deque = collections.deque(maxlen=500)  # metrics for late-joining pages
        self.service = None
        if self.is_server:
            self.generator = Generator(self.coordinator, self.tokenizer, self.tokenizer.vocab_size)
            if self.during_training:
                self._start_service(config.port, "train")

    def _start_service(self, port: int, mode: str) -> None:
        from megatron.scope.server import ServerConfig
        from megatron.scope.service import ScopeService

        config = ServerConfig(host=self.config.host, port=port)
        if self.config.token:
            config.token = self.config.token
        self.service = ScopeService(self.generator, config, mode=mode)
        self.service.on_train = self._on_train
        self.service.train_state = self._train_state
        url = self.service.start()
        print(f"[MegaScope] {'training' if mode == 'train' else 'generation'} views: open {url}", flush=True)

    # --- server thread: UI requests --------------------------------------------------------
    def _on_train(self, job, request: dict) -> None:
        if "sample" in request:
            from megatron.scope.protocol import ProtocolError

            try:
                ids = self.tokenizer.tokenize(request["sample"])
            except ValueError as exc:
                raise ProtocolError(f"sample: {exc}", code="bad_sample") from None
            if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):  # NullTokenizer reads any integer
                raise ProtocolError(f"sample: token ids must be in 0..{self.tokenizer.vocab_size - 1}",
                                    code="bad_sample")
        with self.lock:
            action = request["action"]
            if action == "start":
                self.paused, self.steps_allowed = False, 0
            elif action == "pause":
                self.paused = True
            else:
                self.paused, self.steps_allowed = True, self.steps_allowed + 1
            self.sample = request.get("sample", self.sample)
            self.perturbations = request.get("perturbations", self.perturbations)
            self.observe_every = request.get("observe_every", self.observe_every)
        self.service.server.send(None, "json", {"type": "train_status", "training": self._train_state()})

    def _train_state(self) -> dict[str, Any]:
        return {"iteration": getattr(self, "iteration", 0), "paused": self.paused, "sample": self.sample,
                "history": list(self.history)}

    # --- trainer hooks ---------------------------------------------------------------------
    def before_iteration(self, ctx, iteration: int) -> None:
        self.iteration = iteration
        if self.is_server:
            plan = self._wait_for_permission(iteration) if self.during_training else {}
            self.coordinator.send("iteration", plan)
        else:
            command, plan = self.coordinator.follow()
            if command != "iteration":
                raise RuntimeError(f"MegaScope: rank {ctx.rank} expected 'iteration' from rank 0, got {command!r}")
        self.plan = plan or {}
        from megatron.scope.perturb import PerturbationHooks

        perturbations = self.plan.get("perturbations", [])
        if perturbations:
            hooks = PerturbationHooks(ctx.chunks, perturbations, self.runner.info.num_heads, self.runner.tp_rank,
                                      self.runner.info.tp, num_query_groups=self.runner.info.num_query_groups)
            self.active_perturbations = hooks.active()
            self.active_perturbations.__enter__()

    def _wait_for_permission(self, iteration: int) -> dict[str, Any]:
        """Rank 0: serve UI jobs while paused; return what every rank must know this iteration."""
        while self.service.process_pending(0):
            pass  # requests that arrived while the last iteration ran
        announced = False
        while True:
            with self.lock:
                if not self.paused:
                    break
                if self.steps_allowed > 0:
                    self.steps_allowed -= 1
                    break
            if not announced:
                self.service.server.send(None, "json", {"type": "train_status", "training": self._train_state()})
                announced = True
            self.service.process_pending(0.2)  # generation and PCA requests run while paused
        with self.lock:
            observe = bool(self.service.server.clients) and iteration % self.observe_every == 0
            return {"perturbations": list(self.perturbations), "observe": observe,
                    "sample": self._sample_tokens()}

    def _sample_tokens(self) -> list[int]:
        try:
            ids = self.tokenizer.tokenize(self.sample)
        except ValueError:  # e.g. NullTokenizer (mock data) reads only integers
            ids = list(range(1, 9))
        return ids[-self.runner.info.max_positions:] or [self.tokenizer.eod]

    def before_optimizer_step(self, ctx, iteration: int) -> None:
        if self.active_perturbations is not None:
            # Weights go back before the update; the gradients were taken with the noise in place.
            self.active_perturbations.__exit__(None, None, None)
            self.active_perturbations = None
        if self.plan.get("observe"):
            self.layer_norms = self._layer_grad_norms(ctx)

    def after_iteration(self, ctx, iteration: int, metrics: dict[str, Any]) -> None:
        if not self.plan.get("observe"):
            return
        metrics = dict(metrics, **{"lm loss": self._mean_loss(metrics.get("lm loss"))})
        tokens = torch.tensor([self.plan["sample"] or [self.tokenizer.eod]])
        for chunk in ctx.chunks:
            chunk.eval()
        result = self.coordinator.runner.forward(
            tokens=tokens, capture=["qkv", "attention", "fc1", "fc2", "layer"],
            perturbations=self.plan.get("perturbations", []), lens_top_k=5)
        if self.is_server and self.service is not None:
            self._publish(iteration + 1, tokens, result, metrics)  # numbered as the training log

    def _publish(self, iteration: int, tokens: torch.Tensor, result, metrics: dict[str, Any]) -> None:
        from megatron.scope.engine import GenerateRequest

        send = self.service.server.send
        loss = metrics.get("lm loss")
        point = {"iteration": iteration, "loss": None if loss is None else float(loss),
                 "grad_norm": float(metrics.get("grad norm") or 0.0), "layer_grad_norms": self.layer_norms}
        self.history.append(point)
        send(None, "json", {"type": "train_metrics", "point": point}, False)
        ids = tokens[0].tolist()
        request = GenerateRequest(request_id=-1, capture=["qkv", "attention", "fc1", "fc2", "layer"], lens=True)
        send(None, "json", {"type": "start", "request": -1, "iteration": iteration,
                            "prompts": [[[t, self.generator.token_text(t)] for t in ids]]}, True)
        rows = [list(range(len(ids)))]
        picked = self.generator.next_tokens(result.logits, [len(ids)], request, None)
        frame = self.generator.step_message(request, 0, [ids], rows, [len(ids)], picked, result,
                                            extra={"iteration": iteration})
        send(None, "frame", frame, True)
        send(None, "json", {"type": "done", "request": -1, "steps": 1, "iteration": iteration,
                            "texts": [self.tokenizer.detokenize(ids)],
                            "tokens": [[[t, self.generator.token_text(t)] for t in ids]]}, True)

    @staticmethod
    def _mean_loss(loss: float | None) -> float | None:
        """The loss lives on the last pipeline stage; average it over the ranks that have it."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return loss
        total = torch.tensor([0.0 if loss is None else float(loss), 0.0 if loss is None else 1.0],
                             dtype=torch.float64)
        dist.all_reduce(total)
        return float(total[0] / total[1]) if total[1] > 0 else None

    def _layer_grad_norms(self, ctx) -> list[float]:
        """L2 norm of each layer's gradient over the whole model (collective over all ranks)."""
        from megatron.core import parallel_state as ps

        norms = torch.zeros(self.runner.info.num_layers, dtype=torch.float64)
        tp_rank = self.runner.tp_rank
        for chunk in ctx.chunks:
            for layer in getattr(chunk, "module", chunk).decoder.layers:
                for param in layer.parameters():
                    grad = getattr(param, "main_grad", None) if param.grad is None else param.grad
                    if grad is None:
                        continue
                    # Replicated parameters count on TP rank 0 only; shards add up across TP.
                    if not getattr(param, "tensor_model_parallel", False) and tp_rank != 0:
                        continue
                    norms[layer.layer_number - 1] += grad.detach().double().pow(2).sum().cpu()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(norms)
            norms /= ps.get_data_parallel_world_size()  # every DP replica holds the same gradient
        return norms.sqrt().tolist()

    def shutdown(self, ctx) -> None:
        if self.config.serve_after:
            self._serve_after_training()
        elif self.is_server and self.service is not None:
            self.service.close()

    def _serve_after_training(self) -> None:
        """Generation on the trained model until the UI's server is interrupted (Ctrl-C)."""
        for chunk in self.runner.chunks:
            chunk.eval()
        if not self.is_server:
            self.coordinator.follow()  # until rank 0 sends "exit"
            return
        if self.service is None:
            self._start_service(self.config.port, "generate")
        self.service.mode = "generate"
        self.service.on_train = None
        print(f"[MegaScope] training done; serving generation on the trained model at {self.service.server.url} "
              "(Ctrl-C to stop)", flush=True)
        try:
            self.service.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.coordinator.send("exit")
            self.service.close()
