"""MegaScope: watch a megatron-core GPT think — live captures, perturbations, PCA and logit lens
streamed over a WebSocket to a browser app, for generation and for training."""
