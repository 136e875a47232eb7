"""Rank body for the tensor-parallel tests (run by test_tp.py through ``cpu.run_gloo``; kept out of the
test module so that a spawned child imports only this file)."""

from __future__ import annotations

import torch


def run_rank(rank: int, world: int, ckpt: str, bf16_ckpt: str, plan: list, out_path: str) -> None:
    """Decode ``plan`` with this rank's shard: fp32 from ``ckpt``, bf16 from ``bf16_ckpt``."""
    from k3compile.models import load_pretrained

    result = {}
    for name, dtype, path in (("fp32", torch.float32, ckpt), ("bf16", torch.bfloat16, bf16_ckpt)):
        model = load_pretrained(path, dtype=dtype, tp_rank=rank, tp_size=world)
        state = model.new_state(max(len(ids) for ids in plan), len(plan) + 1)
        with torch.no_grad():
            result[name] = [model.decode(torch.tensor(ids, dtype=torch.long), state).clone() for ids in plan]
        result[name + "_lengths"] = state.lengths.clone()
    if rank == 0:
        torch.save(result, out_path)
