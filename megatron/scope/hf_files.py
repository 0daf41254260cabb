"""Reading a local Hugging Face model directory: its config.json (GPT-2 or Llama) and its weights
(safetensors, sharded safetensors or a .bin), shared by the GPT-2 and the Llama importers."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron.scope.loading import ModelLoadError

SUPPORTED = ("gpt2", "llama")


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: --hf-model needs a Hugging Face model directory "
                             "(config.json, weights, tokenizer files)")
    config = json.loads(path.read_text())
    model_type = config.get("model_type", "gpt2")
    if model_type not in SUPPORTED:
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported; MegaScope imports "
                             f"{' and '.join(SUPPORTED)} models")
    return config


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in float32, by its Hugging Face name."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.is_file() or single.is_file():
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ModelLoadError("safetensors weights need the safetensors package (pip install safetensors)") from exc
        files = [single] if single.is_file() else sorted(
            {directory / name for name in json.loads(index.read_text())["weight_map"].values()})
        weights: dict[str, torch.Tensor] = {}
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{file} is missing: {index.name} names it")
            weights.update(load_file(str(file)))
    elif (directory / "pytorch_model.bin").is_file():
        weights = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{directory} holds neither model.safetensors (or its index) nor pytorch_model.bin")
    return {name: value.float() for name, value in weights.items()}
