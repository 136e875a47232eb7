"""Tensor-parallel plumbing for the eager model (k3-architecture.md §3.1).

A model built for ``(tp_rank, tp_size)`` holds only its shard and communicates through
``torch.distributed`` *functional* collectives, so that a graph capture sees each collective as a
node. ``tp_size == 1`` has no collectives at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel position tp_rank={self.rank}, tp_size={self.size}")

    def shard(self, n: int) -> slice:
        """The contiguous slice of ``n`` rows (already checked divisible) owned by this rank."""
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


def _group():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("a tensor-parallel model (tp_size > 1) needs torch.distributed initialised: call "
                           "torch.distributed.init_process_group('gloo' on CPU, 'nccl' on GPU) in every rank first")
    return dist.group.WORLD


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum over the TP group (identity for tp_size 1)."""
    if tp.size == 1:
        return x
    import torch.distributed._functional_collectives as fc
    return fc.all_reduce(x, "sum", _group())


def all_gather_last(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate the ranks' shards along the last dim (identity for tp_size 1)."""
    if tp.size == 1:
        return x
    import torch.distributed._functional_collectives as fc
    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # the former is newer than torch 2.11
    g = gather(x.contiguous(), 0, _group())  # [tp*B, N]
    return torch.cat(torch.chunk(g, tp.size, dim=0), dim=-1)
