"""Temperature / top-p sampling on fp32 logits (greedy at temperature 0)."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of ``logits [B, V]``.

    temperature 0 is greedy (argmax, lowest id on ties). Otherwise softmax(logits / temperature) is
    restricted to the smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
