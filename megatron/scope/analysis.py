"""Analyses computed on the serving rank: PCA of hidden states (NumPy SVD) and top-k."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class PCAResult:
    coords: np.ndarray  # [points, components]
    components: np.ndarray  # [components, hidden]
    explained_variance_ratio: np.ndarray  # [components]
    mean: np.ndarray  # [hidden]


def pca(points: np.ndarray, num_components: int = 2) -> PCAResult:
    """Principal components of the rows of `points` [n, hidden] by SVD of the centred matrix.
    Each component's sign is fixed so that its largest-magnitude loading is positive, which makes
    the picture stable from one request to the next."""
    x = np.asarray(points, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"PCA needs at least two points of shape [n, hidden], got {x.shape}")
    mean = x.mean(axis=0)
    centred = x - mean
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)
    k = min(num_components, vt.shape[0])
    components = vt[:k]
    signs = np.sign(components[np.arange(k), np.abs(components).argmax(axis=1)])
    signs[signs == 0] = 1.0
    components = components * signs[:, None]
    variance = singular**2
    total = variance.sum()
    ratio = variance[:k] / total if total > 0 else np.zeros(k)
    coords = centred @ components.T
    if k < num_components:  # fewer points than components: pad with zeros
        coords = np.pad(coords, ((0, 0), (0, num_components - k)))
        ratio = np.pad(ratio, (0, num_components - k))
        components = np.pad(components, ((0, num_components - k), (0, 0)))
    return PCAResult(coords=coords, components=components, explained_variance_ratio=ratio, mean=mean)


def top_k(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids and softmax probabilities at `temperature` (1 when 0: greedy still shows the
    model's own distribution), plus log of the softmax normaliser [..., 1]. logits [..., vocab].
    Only k probabilities are formed, so reporting a step costs little next to the forward."""
    scaled = logits.float() / temperature if temperature > 0 and temperature != 1.0 else logits.float()
    log_norm = torch.logsumexp(scaled, dim=-1, keepdim=True)
    top = scaled.topk(min(k, scaled.shape[-1]), dim=-1)
    return top.indices, torch.exp(top.values - log_norm), log_norm
