"""Client messages: JSON objects checked field by field against fixed menus and ranges.
Nothing a client sends is evaluated; anything unexpected becomes a ProtocolError, which the
server turns into an error frame."""
from __future__ import annotations

import json
from typing import Any, Callable

from megatron.scope.capture import CAPTURE_KINDS
from megatron.scope.codec import BIN_CHOICES, REDUCE_CHOICES
from megatron.scope.engine import GenerateRequest
from megatron.scope.perturb import Perturbation, PerturbationError
from megatron.scope.runner import ModelInfo

MAX_MESSAGE_BYTES = 64 * 1024
MAX_PROMPTS = 8
MAX_PROMPT_CHARS = 2000
MAX_NEW_TOKENS = 256
MAX_TOP_K = 20
MAX_PERTURBATIONS = 16
TRAIN_ACTIONS = ("start", "pause", "step")


class ProtocolError(ValueError):
    """A client message is malformed; `code` names the kind of problem for the UI."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


def parse_message(text: str | bytes) -> dict[str, Any]:
    if isinstance(text, bytes):
        raise ProtocolError("send JSON text frames; binary frames are server-to-client only")
    if len(text.encode()) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message larger than {MAX_MESSAGE_BYTES} bytes", code="too_large")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError('a message must be a JSON object with a string "type"')
    return data


def _integer(data: dict, name: str, default: int, low: int, high: int) -> int:
    value = data.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"{name} must be an integer in [{low}, {high}]")
    return value


def _number(data: dict, name: str, default: float, low: float, high: float) -> float:
    value = data.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"{name} must be a number in [{low}, {high}]")
    return float(value)


def _choice(data: dict, name: str, default: Any, choices: tuple) -> Any:
    value = data.get(name, default)
    if value not in choices or isinstance(value, bool):
        raise ProtocolError(f"{name} must be one of {list(choices)}")
    return value


def _only(data: dict, allowed: set[str]) -> None:
    unknown = set(data) - allowed - {"type", "id"}
    if unknown:
        raise ProtocolError(f"unknown fields for {data['type']!r}: {sorted(unknown)}")


def perturbations_from(data: Any, info: ModelInfo) -> list[Perturbation]:
    if data is None:
        return []
    if not isinstance(data, list) or len(data) > MAX_PERTURBATIONS:
        raise ProtocolError(f"perturbations must be a list of at most {MAX_PERTURBATIONS} objects")
    try:
        return [Perturbation.from_message(item, info.num_layers, info.num_heads) for item in data]
    except PerturbationError as exc:
        raise ProtocolError(str(exc), code="bad_perturbation") from None


def generate_request(data: dict, info: ModelInfo) -> GenerateRequest:
    _only(data, {"prompts", "max_new_tokens", "capture", "bins", "reduce", "top_k", "temperature", "seed",
                 "lens", "perturbations"})
    prompts = data.get("prompts")
    if (not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_PROMPTS
            or not all(isinstance(p, str) and len(p) <= MAX_PROMPT_CHARS for p in prompts)):
        raise ProtocolError(f"prompts must be 1..{MAX_PROMPTS} strings of at most {MAX_PROMPT_CHARS} characters")
    capture = data.get("capture", [])
    if not isinstance(capture, list) or not all(isinstance(c, str) and c in CAPTURE_KINDS for c in capture):
        raise ProtocolError(f"capture must be a list drawn from {list(CAPTURE_KINDS)}")
    lens = data.get("lens", False)
    if not isinstance(lens, bool):
        raise ProtocolError("lens must be true or false")
    return GenerateRequest(
        request_id=_integer(data, "id", 0, 0, 2**31 - 1),
        prompts=list(prompts),
        max_new_tokens=_integer(data, "max_new_tokens", 8, 1, MAX_NEW_TOKENS),
        capture=sorted(set(capture), key=CAPTURE_KINDS.index),
        bins=_choice(data, "bins", 32, BIN_CHOICES),
        reduce=_choice(data, "reduce", "mean", REDUCE_CHOICES),
        top_k=_integer(data, "top_k", 5, 1, MAX_TOP_K),
        temperature=_number(data, "temperature", 0.0, 0.0, 10.0),
        seed=_integer(data, "seed", 0, 0, 2**31 - 1),
        lens=lens,
        perturbations=perturbations_from(data.get("perturbations"), info),
    )


def pca_request(data: dict, info: ModelInfo) -> dict[str, int]:
    _only(data, set() | {"layer"})
    return {"layer": _integer(data, "layer", 0, 0, info.num_layers - 1)}


def train_request(data: dict, info: ModelInfo) -> dict[str, Any]:
    _only(data, {"action", "sample", "perturbations", "observe_every"})
    request: dict[str, Any] = {"action": _choice(data, "action", None, TRAIN_ACTIONS)}
    if "sample" in data:
        sample = data["sample"]
        if not isinstance(sample, str) or not 0 < len(sample) <= MAX_PROMPT_CHARS:
            raise ProtocolError(f"sample must be a non-empty string of at most {MAX_PROMPT_CHARS} characters")
        request["sample"] = sample
    if "perturbations" in data:
        request["perturbations"] = perturbations_from(data["perturbations"], info)
    if "observe_every" in data:
        request["observe_every"] = _integer(data, "observe_every", 1, 1, 1000)
    return request


def empty_request(data: dict, info: ModelInfo) -> dict[str, Any]:
    _only(data, set())
    return {}


# Message type -> validator; the server looks handlers up here, never by string building.
VALIDATORS: dict[str, Callable[[dict, ModelInfo], Any]] = {
    "generate": generate_request,
    "stop": empty_request,
    "pca": pca_request,
    "train": train_request,
    "ping": empty_request,
}


def validate(data: dict, info: ModelInfo) -> Any:
    validator = VALIDATORS.get(data["type"])
    if validator is None:
        raise ProtocolError(f"unknown message type {data['type']!r}; known: {sorted(VALIDATORS)}", code="unknown_type")
    return validator(data, info)
