"""Token-by-token generation with live captures, and the command loop that keeps every rank
of a TP/PP job in step with the serving rank (global rank 0)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron.scope.analysis import PCAResult, pca, top_k
from megatron.scope.codec import reduce_bins
from megatron.scope.perturb import Perturbation
from megatron.scope.runner import ForwardResult, ModelRunner

# (kind, payload, droppable): "json" with a dict, or "frame" with (header, arrays), which the
# server thread encodes so the model thread never serialises.
Emit = Callable[[str, Any, bool], None]


@dataclass(kw_only=True, slots=True)
class GenerateRequest:
    request_id: int = 0
    prompts: list[str] = field(default_factory=lambda: ["Hello"])
    max_new_tokens: int = 8
    capture: list[str] = field(default_factory=list)
    bins: int = 32
    reduce: str = "mean"
    top_k: int = 5
    temperature: float = 0.0
    seed: int = 0
    lens: bool = False
    perturbations: list[Perturbation] = field(default_factory=list)


class NextTokens(NamedTuple):
    """One step's choice per sample: the chosen ids and their probabilities, and the top-k ids
    with their probabilities (what the step frame shows)."""

    chosen: list[int]
    chosen_probs: list[float]
    top_ids: list[list[int]]
    top_probs: list[list[float]]


class PromptError(ValueError):
    """A prompt this model's tokenizer cannot turn into token ids; the message says what it accepts."""

    code = "bad_prompt"


def prompt_format(tokenizer, vocab_size: int) -> str | None:
    """What a prompt is when it is not text: a NullTokenizer (pretrain_gpt.py --mock-data) reads
    token ids. None for tokenizers that read text."""
    from megatron.app.tokenizer import NullTokenizer

    if isinstance(tokenizer, NullTokenizer):
        return (f"this model was trained with NullTokenizer (e.g. pretrain_gpt.py --mock-data), so a prompt is "
                f"token ids separated by spaces, each in 0..{vocab_size - 1}, e.g. \"1 2 3\"")
    return None


def leave_process_group() -> None:
    """Every rank of a serving job leaves together once rank 0 has sent "exit": one that exits
    while a peer's gloo threads still talk to it has aborted that peer (SIGABRT, "terminate
    called without an active exception")."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


class Coordinator:
    """Rank 0 broadcasts each command; the other ranks run `follow()` and obey. One rank: direct."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.distributed = runner.distributed

    def forward(self, **kwargs: Any) -> ForwardResult:
        if self.distributed:
            dist.broadcast_object_list([("forward", kwargs)], src=0)
        return self.runner.forward(**kwargs)

    def send(self, command: str, payload: Any = None) -> None:
        """A non-forward command ("exit", "resume", "idle", or one a caller handles)."""
        if self.distributed:
            dist.broadcast_object_list([(command, payload)], src=0)

    def follow(self, handlers: dict[str, Callable[[Any], None]] | None = None) -> tuple[str, Any]:
        """Obey rank 0 until it sends a command not handled here; return it with its payload."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            command, payload = box[0]
            if command == "forward":
                self.runner.forward(**payload)
            elif command == "idle":
                continue
            elif handlers and command in handlers:
                handlers[command](payload)
            else:
                return command, payload


class Generator:
    """Generation on rank 0; all model work goes through the Coordinator."""

    def __init__(self, coordinator: Coordinator, tokenizer, vocab_size: int) -> None:
        self.coordinator = coordinator
        self.tokenizer = tokenizer
        self.info = coordinator.runner.info
        self.vocab_size = vocab_size
        # Hidden states of the latest generation, per layer, for PCA: rows and their labels.
        self.hidden_rows: dict[int, list[np.ndarray]] = {}
        self.hidden_labels: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def token_text(self, token: int) -> str:
        try:
            return self.tokenizer.detokenize([int(token)])
        except Exception:  # ids past the tokenizer (padded vocab) still need a label
            return f"<{int(token)}>"

    def encode_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        limit = max(1, self.info.max_positions - 1)
        encoded = []
        for prompt in prompts:
            # Checked here, on rank 0, so no rank ever runs a forward on ids the model has no row for.
            try:
                ids = self.tokenizer.tokenize(prompt) if prompt else []
            except ValueError:
                ids = None
            if ids is None or any(not 0 <= t < self.vocab_size for t in ids):
                hint = prompt_format(self.tokenizer, self.vocab_size) or \
                    f"its tokens must be ids in 0..{self.vocab_size - 1}"
                shown = prompt if len(prompt) <= 40 else prompt[:40] + "..."
                raise PromptError(f"prompt {shown!r} cannot be used: {hint}")
            encoded.append((ids or [self.tokenizer.eod])[-limit:])
        return encoded

    def generate(self, request: GenerateRequest, emit: Emit, should_stop: Callable[[], bool] = lambda: False) -> dict:
        sequences = self.encode_prompts(request.prompts)
        generator = torch.Generator().manual_seed(request.seed)
        pad = self.tokenizer.eod
        keep_hidden = "layer" in request.capture
        if keep_hidden:
            with self.lock:
                self.hidden_rows, self.hidden_labels = {}, []
        emit("json", {"type": "start", "request": request.request_id,
                      "prompts": [[[t, self.token_text(t)] for t in seq] for seq in sequences]}, False)
        steps = 0
        for step in range(request.max_new_tokens):
            if should_stop() or max(len(s) for s in sequences) >= self.info.max_positions:
                break
            lengths = [len(s) for s in sequences]
            width = max(lengths)
            tokens = torch.tensor([s + [pad] * (width - len(s)) for s in sequences], dtype=torch.long)
            # The new positions of this step: the whole prompt first, then the latest token.
            rows = [list(range(width))] * len(sequences) if step == 0 else [[n - 1] for n in lengths]
            needs_rows = bool(request.capture) or request.lens
            positions = torch.tensor(rows) if needs_rows else None
            result = self.coordinator.forward(
                tokens=tokens, capture=list(request.capture), perturbations=list(request.perturbations),
                positions=positions, lens_top_k=request.top_k if request.lens else 0,
            )
            picked = self.next_tokens(result.logits, lengths, request, generator)
            frame = self.step_message(request, step, sequences, rows, lengths, picked, result)
            if keep_hidden:
                self._keep_hidden(result.captures["layer"], rows, lengths, sequences)
            emit("frame", frame, True)
            for seq, token in zip(sequences, picked.chosen):
                seq.append(token)
            steps += 1
        summary = {"type": "done", "request": request.request_id, "steps": steps,
                   "texts": [self.tokenizer.detokenize(s) for s in sequences],
                   "tokens": [[[t, self.token_text(t)] for t in s] for s in sequences]}
        return summary

    def next_tokens(self, logits: torch.Tensor, lengths: list[int], request: GenerateRequest,
                    generator: torch.Generator | None) -> NextTokens:
        """The chosen ids, their probabilities, the top-k ids and their probabilities per sample,
        as Python lists. Greedy decoding (temperature 0, where `generator` may be None) takes the
        top-1 of the top-k, so a step costs a handful of ops."""
        if all(n == lengths[0] for n in lengths):
            last = logits[:, lengths[0] - 1, : self.vocab_size]
        else:
            last = logits[torch.arange(len(lengths)), torch.tensor(lengths) - 1, : self.vocab_size]
        ids, values, log_norm = top_k(last, request.top_k, request.temperature)
        ids, values = ids.tolist(), values.tolist()
        if request.temperature <= 0:
            return NextTokens([row[0] for row in ids], [row[0] for row in values], ids, values)
        probs = torch.exp(last.float() / request.temperature - log_norm)
        chosen = torch.multinomial(probs, 1, generator=generator)
        return NextTokens(chosen[:, 0].tolist(), probs.gather(1, chosen)[:, 0].tolist(), ids, values)

    def step_message(self, request: GenerateRequest, step: int, sequences: Sequence[Sequence[int]],
                     positions: list[list[int]], lengths: list[int], picked: NextTokens, result: ForwardResult,
                     extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The "step" frame of one forward as (header, arrays), for `emit("frame", ...)`: per sample
        the new positions' tokens, the sampled token and the top-k; the captures reduced to
        `request.bins`; the logit lens with its vocabulary. `positions[b]` are sample b's new
        positions (those at or past `lengths[b]` are padding); `extra` adds header fields (the
        trainer numbers its frames with "iteration"). Generation and the trainer plugin both send
        what this returns, so the page reads one format."""
        header = self._step_header(request, step, sequences, positions, lengths, picked)
        header.update(extra or {})
        arrays = self._step_arrays(request, result, header)
        return header, arrays

    def _step_header(self, request: GenerateRequest, step: int, sequences: Sequence[Sequence[int]],
                     positions: list[list[int]], lengths: list[int], picked: NextTokens) -> dict[str, Any]:
        chosen, chosen_probs, ids, values = picked
        samples = []
        for b, seq in enumerate(sequences):
            rows = [p for p in positions[b] if p < lengths[b]]
            samples.append({
                "length": lengths[b],
                "positions": rows,
                "tokens": [[seq[p], self.token_text(seq[p])] for p in rows],
                "sampled": {"id": chosen[b], "text": self.token_text(chosen[b]), "prob": chosen_probs[b]},
                "topk": [[i, self.token_text(i), v] for i, v in zip(ids[b], values[b])],
            })
        return {"type": "step", "request": request.request_id, "step": step,
                "bins": request.bins, "reduce": request.reduce, "samples": samples, "positions": positions}

    def _step_arrays(self, request: GenerateRequest, result: ForwardResult, header: dict) -> dict:
        arrays: dict[str, Any] = {}
        for kind, value in result.captures.items():
            if kind == "attention":
                arrays[kind] = value  # [layers, batch, heads, positions, keys]
            else:
                arrays[kind] = reduce_bins(value, request.bins, request.reduce)  # [layers, batch, positions, bins]
        if result.lens_ids is not None:
            arrays["lens_ids"] = result.lens_ids.to(torch.int32)  # [layers, batch, positions, k]
            arrays["lens_probs"] = result.lens_probs
            header["lens_vocab"] = {str(i): self.token_text(i) for i in set(result.lens_ids.flatten().tolist())}
        return arrays

    def _keep_hidden(self, layers: torch.Tensor, positions: list[list[int]], lengths, sequences) -> None:
        # layers: [layers, batch, positions, hidden]
        with self.lock:
            for b in range(layers.shape[1]):
                for j, p in enumerate(positions[b]):
                    if p >= lengths[b]:
                        continue
                    for layer in range(layers.shape[0]):
                        self.hidden_rows.setdefault(layer, []).append(layers[layer, b, j].numpy())
                    self.hidden_labels.append({"sample": b, "position": int(p),
                                               "text": self.token_text(sequences[b][p])})

    def pca(self, layer: int) -> tuple[PCAResult, list[dict[str, Any]]]:
        with self.lock:
            rows = self.hidden_rows.get(layer)
            if not rows or len(rows) < 2:
                raise ValueError("no hidden states yet: generate with the 'layer' capture on first")
            return pca(np.stack(rows), 2), list(self.hidden_labels)
