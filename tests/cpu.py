"""CPU test helpers: one intra-op thread, and running a function in ``world`` processes joined in a gloo
group (the TP tests on machines without GPUs)."""

from __future__ import annotations

import contextlib
import datetime
import tempfile

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


GLOO_TIMEOUT = datetime.timedelta(minutes=10)  # a rank stuck in the rendezvous or a collective raises (under
# pytest-timeout's 15 minutes, with the rank's own error)


def _entry(rank: int, fn, world: int, init: str, args: tuple) -> None:
    """One rank: ``fn`` in a gloo group, then a barrier and an exit without the gloo teardown.

    ``destroy_process_group()`` (and the interpreter's own teardown of a live gloo group) while a peer
    rank is still closing its sockets sometimes aborts the process ("terminate called without an active
    exception", SIGABRT: seen once in CI on test_tp_matches_tp1[2]), failing a run whose results were
    all written. ``k3compile.comm.leave`` waits for every rank and exits with ``os._exit``. A rank whose
    ``fn`` raises lets the exception through: the spawn wrapper records it and the parent re-raises it.
    """
    import torch.distributed as dist

    from k3compile.comm import leave

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=GLOO_TIMEOUT)
    torch.set_num_threads(1)  # `world` processes share the machine's cores
    fn(rank, world, *args)
    leave(0)


def run_gloo(fn, world: int, *args) -> None:
    """``fn(rank, world, *args)`` in every rank; raises if any rank fails. ``fn`` must be importable
    (a module-level function) because ranks are spawned. The ranks meet through a file store of their own
    (a fresh directory), not a TCP port: a port picked free and released before rank 0 binds it can be taken
    by another test's group running beside this one (pytest-xdist), whose store the other ranks then join
    (one CI run hung 900 s in test_tp2_gloo_matches_eager, passing alone in 60 s)."""
    with tempfile.TemporaryDirectory(prefix="k3gloo") as d:
        mp.start_processes(_entry, args=(fn, world, f"file://{d}/store", args), nprocs=world, join=True,
                           start_method="spawn")
