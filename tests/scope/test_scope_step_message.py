"""One step frame format: the trainer plugin sends through `Generator.step_message`, the call the
generation loop makes, so its frame is generation's frame plus the iteration, byte for byte."""
from __future__ import annotations

import collections
import re
import types
from pathlib import Path

import torch

from megatron.scope.codec import encode_frame
from megatron.scope.engine import GenerateRequest

CAPTURES = ["qkv", "attention", "fc1", "fc2", "layer"]  # what the plugin streams
SAMPLE = "Return the number"


def _plugin_messages(tiny_model, generator, iteration: int) -> list[tuple[str, object]]:
    from megatron.scope.plugin import ScopePlugin

    plugin = ScopePlugin()
    sent: list[tuple[str, object]] = []
    server = types.SimpleNamespace(send=lambda client, kind, payload, droppable=False: sent.append((kind, payload)))
    plugin.service = types.SimpleNamespace(server=server)
    plugin.history, plugin.layer_norms = collections.deque(), [0.5, 0.25, 0.125]
    plugin.tokenizer, plugin.generator = tiny_model.tokenizer, generator
    tokens = torch.tensor([tiny_model.tokenizer.tokenize(SAMPLE)])
    result = tiny_model.runner.forward(tokens=tokens, capture=CAPTURES, perturbations=[], lens_top_k=5)
    plugin._publish(iteration, tokens, result, {"lm loss": 2.5, "grad norm": 1.0})
    return sent


def test_plugin_frame_is_the_generation_frame_with_its_iteration(tiny_model, generator):
    sent = _plugin_messages(tiny_model, generator, iteration=7)
    assert [kind for kind, _ in sent] == ["json", "json", "frame", "json"]
    plugin_header, plugin_arrays = sent[2][1]

    emitted = []
    generator.generate(GenerateRequest(request_id=-1, prompts=[SAMPLE], max_new_tokens=1, capture=CAPTURES, lens=True),
                       lambda kind, payload, droppable: emitted.append((kind, payload)))
    frames = [payload for kind, payload in emitted if kind == "frame"]
    assert len(frames) == 1
    header, arrays = frames[0]

    # the same fields in the same order, the iteration after generation's own and before the lens vocabulary
    assert list(header) == ["type", "request", "step", "bins", "reduce", "samples", "positions", "lens_vocab"]
    assert list(plugin_header) == ["type", "request", "step", "bins", "reduce", "samples", "positions", "iteration",
                                   "lens_vocab"]
    assert plugin_header["iteration"] == 7
    assert {k: v for k, v in plugin_header.items() if k != "iteration"} == header
    assert plugin_arrays.keys() == arrays.keys() == {*CAPTURES, "lens_ids", "lens_probs"}
    for name, value in arrays.items():
        torch.testing.assert_close(plugin_arrays[name], value, rtol=0, atol=0, msg=name)
    with_iteration = {k: v for k, v in header.items() if k != "lens_vocab"}
    with_iteration.update(iteration=7, lens_vocab=header["lens_vocab"])
    assert encode_frame(plugin_header, plugin_arrays) == encode_frame(with_iteration, arrays)


def test_step_message_returns_what_the_generation_loop_emits(tiny_model, generator):
    """Two samples of different lengths (padding rows dropped from the header), sampling on."""
    request = GenerateRequest(prompts=["ab", "a longer one"], max_new_tokens=2, capture=["fc1", "attention"], bins=8,
                              reduce="max", temperature=0.7, seed=3, lens=True)
    emitted = []
    generator.generate(request, lambda kind, payload, droppable: emitted.append((kind, payload)))
    first_header, first_arrays = next(payload for kind, payload in emitted if kind == "frame")

    sequences = generator.encode_prompts(request.prompts)
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    tokens = torch.tensor([s + [tiny_model.tokenizer.eod] * (width - len(s)) for s in sequences])
    rows = [list(range(width))] * len(sequences)
    result = tiny_model.runner.forward(tokens=tokens, capture=request.capture, perturbations=[],
                                       positions=torch.tensor(rows), lens_top_k=request.top_k)
    picked = generator.next_tokens(result.logits, lengths, request, torch.Generator().manual_seed(request.seed))
    header, arrays = generator.step_message(request, 0, sequences, rows, lengths, picked, result)
    assert encode_frame(header, arrays) == encode_frame(first_header, first_arrays)
    assert [len(sample["positions"]) for sample in header["samples"]] == lengths


def test_the_plugin_uses_no_private_generator_calls():
    import megatron.scope.plugin

    source = Path(megatron.scope.plugin.__file__).read_text()
    private = re.findall(r"generator\._\w+", source)
    assert not private, f"megatron/scope/plugin.py reaches into the Generator's private calls: {private}"
