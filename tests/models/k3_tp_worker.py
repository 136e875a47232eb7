"""Rank body for the tensor-parallel tests (spawned by test_tp.py; kept out of the test module so
that a spawned child imports only this file)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def run_rank(rank: int, world: int, port: int, ckpt: str, bf16_ckpt: str, plan: list, out_path: str) -> None:
    """Decode ``plan`` with this rank's shard: fp32 from ``ckpt``, bf16 from ``bf16_ckpt``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
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
    finally:
        dist.destroy_process_group()
