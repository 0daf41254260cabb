"""The GPT-2 importer: a randomly initialised transformers GPT2LMHeadModel saved locally gives
the same logits after import into megatron-core's GPTModel (no download anywhere)."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the GPT-2 importer test compares with transformers")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (written out here, not imported)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2")
    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    config = transformers.GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=48, n_layer=3, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=256, eos_token_id=256)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # biases and norms away from their 0/1 init, so a mix-up would show
        for name, param in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory, model


def test_imported_gpt2_gives_the_same_logits(gpt2_dir):
    from megatron.scope.gpt2 import load_gpt2

    directory, reference = gpt2_dir
    loaded = load_gpt2(str(directory))
    text = "MegaScope reads GPT-2!"
    ids = loaded.tokenizer.tokenize(text)
    assert len(ids) == len(text.encode())  # byte-level vocabulary without merges: one id per byte
    tokens = torch.tensor([ids])
    with torch.no_grad():
        want = reference(tokens).logits
    got = loaded.runner.forward(tokens, capture=["attention"]).logits[..., : want.shape[-1]]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert loaded.runner.info.num_layers == 3 and loaded.runner.info.vocab_size == 257


def test_importer_errors_name_the_missing_file(tmp_path):
    from megatron.scope.gpt2 import load_gpt2
    from megatron.scope.loading import ModelLoadError

    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_gpt2(str(tmp_path))
