"""CPU test helpers: one intra-op thread, and running a function in ``world`` processes joined in a gloo
group (the TP tests on machines without GPUs)."""

from __future__ import annotations

import contextlib
import socket

import torch
import torch.multiprocessing as mp


@contextlib.contextmanager
def one_thread():
    """One intra-op thread: k3-mini's ops are tiny, and OpenMP spin-waiting makes them ~10x slower
    when the machine's cores are shared. Restores the previous setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, args: tuple) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)  # `world` processes share the machine's cores
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world: int, *args) -> None:
    """``fn(rank, world, *args)`` in every rank; raises if any rank fails. ``fn`` must be importable
    (a module-level function) because ranks are spawned."""
    mp.start_processes(_entry, args=(fn, world, free_port(), args), nprocs=world, join=True, start_method="spawn")
