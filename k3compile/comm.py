"""The all-reduce inside the fused residual kernels (``residual_attn_res`` with ``TP > 1``).

The o_proj / FFN partial sums of the TP ranks are summed by the kernel that consumes them (residual add,
AttnRes, RMSNorm): one launch, no separate collective. The kernel reads every rank's row through
peer-accessible buffers and synchronises with epoch flags (see ``templates/kernels/residual_attn_res.py``).
This module gives a kernel call its communication arguments, in one of two wirings::

    one-shot (real ranks, symmetric memory, message <= oneshot_max_bytes):
        comm = this rank's symmetric buffer       peer<p> = rank p's buffer (peer<rank> is comm)
        signal = this rank's flag pad             peer_signal<p> = rank p's flag pad
        -> the kernel exchanges the rows itself over NVLink (peer loads, no multicast)

    local (single-GPU emulation of TP > 1 on a fake process group, or after an NCCL all-reduce):
        a = the partial (emulation) or all_reduce(partial) (NCCL, torch.distributed; gloo on the CPU)
        peer0 = a, peer1.. = a zero row block     every peer_signal<p> = this rank's own pad
        -> the same kernel: it recognises the wiring (peer_signal0 and peer_signal1 are one pad, which no
           two real ranks share) and skips the exchange (no copy, flag, wait or peer read): a is the sum

``oneshot_max_bytes`` gates the one-shot path by the size of one rank's message (rows x hidden x 2 bytes):
each rank reads every peer's message, so for large messages NCCL's ring wins. Real collectives are counted
(``collective:one_shot`` per fused exchange, ``collective:all_reduce`` per NCCL call).

Symmetric memory comes from ``torch.distributed._symmetric_memory`` (CUDA). NVLink multicast is never
used: no multimem instruction, no multicast object (keep ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` set on
shared hosts). Buffers and flag pads are allocated once per (rows, hidden) at the first call (a collective
rendezvous: every rank makes the same calls in the same order) and live as long as the process; the flags
are monotonic epochs, so captured CUDA graphs replay with no reset.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("k3compile")

ONESHOT_MAX_BYTES = 1 << 20  # one rank's message; K3 (hidden 7168, bf16): every bucket up to 64 rows
# NVLink multicast stays off: a program using it can take a shared host's GPUs out of service
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def torchrun_world() -> int:
    """The world size when started by torchrun (several processes), else 1."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def init_ranks() -> int:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), unless one is
    already initialised: NCCL with one GPU per rank and NVLink multicast off, or gloo without CUDA.
    Returns this process's rank."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            for var, val in MULTICAST_OFF.items():
                os.environ.setdefault(var, val)
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
    return dist.get_rank()


def leave(rc: int = 0) -> None:
    """End a multi-rank process once every rank is done. torch 2.11's ``destroy_process_group()`` hangs
    while CUDA graphs that captured NCCL collectives are alive (compiled steps keep theirs), so the
    process exits without the teardown."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


class CommError(RuntimeError):
    pass


def _rank(group: str) -> int:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_rank(_resolve_process_group(group))


class _Symmetric:
    """Symmetric buffers and flag pads of one process group on one device, per (rows, hidden)."""

    def __init__(self, group: str, tp: int, device):
        self.group, self.tp, self.device = group, tp, torch.device(device)
        self.rank = _rank(group)
        self.buffers: dict = {}  # (m, d) -> (comm, [peer buffers])
        self.pads: dict = {}  # m -> (signal, [peer pads])

    def _alloc(self, shape, dtype):
        import warnings

        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a deprecated no-op later
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group)
        t = symm_mem.empty(*shape, dtype=dtype, device=self.device)
        t.zero_()
        h = symm_mem.rendezvous(t, self.group)
        peers = [t if p == self.rank else h.get_buffer(p, tuple(shape), dtype) for p in range(self.tp)]
        h.barrier()  # every rank's zeros are in place before any rank raises a flag
        return t, peers

    def args(self, m: int, d: int) -> dict:
        if (m, d) not in self.buffers:
            self.buffers[m, d] = self._alloc((m, d), torch.bfloat16)
        if m not in self.pads:
            self.pads[m] = self._alloc((2, m), torch.int32)
        comm, peers = self.buffers[m, d]
        signal, pads = self.pads[m]
        out = {"comm": comm, "signal": signal}
        out.update({f"peer{p}": t for p, t in enumerate(peers)})
        out.update({f"peer_signal{p}": t for p, t in enumerate(pads)})
        return out


class _Local:
    """This rank's own buffer, flag pad and a zero row block per (rows, hidden): the local wiring."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.buffers: dict = {}

    def args(self, a: torch.Tensor, tp: int) -> dict:
        a = a.contiguous()
        m, d = a.shape
        if (m, d) not in self.buffers:
            self.buffers[m, d] = (torch.empty(m, d, dtype=torch.bfloat16, device=self.device),
                                  torch.zeros(2, m, dtype=torch.int32, device=self.device),
                                  torch.zeros(m, d, dtype=torch.bfloat16, device=self.device))
        comm, signal, zero = self.buffers[m, d]
        out = {"a": a, "comm": comm, "signal": signal, "peer0": a}
        out.update({f"peer{p}": zero for p in range(1, tp)})
        out.update({f"peer_signal{p}": signal for p in range(tp)})
        return out


_SYMMETRIC: dict = {}  # (group, tp, device) -> _Symmetric | None (unavailable)
_LOCAL: dict = {}  # device -> _Local


def symmetric_available(group: str, tp: int, device) -> bool:
    """Whether one-shot buffers exist (or can be made) for this group: CUDA, a real process group, and
    torch's symmetric memory working. Decided once per group (a collective call: all ranks ask together)."""
    key = (group, tp, str(device))
    if key not in _SYMMETRIC:
        ok = torch.device(device).type == "cuda"
        if ok:
            try:
                sym = _Symmetric(group, tp, device)
                sym.args(1, 256)  # a real rendezvous now, so a failure shows here and not mid-step
                _SYMMETRIC[key] = sym
            except Exception as e:  # noqa: BLE001 - any failure means: use NCCL, and say so
                log.warning("k3compile: symmetric memory is not available for group %s (%s: %s); the fused "
                            "residual kernels take their all-reduce from NCCL instead", group, type(e).__name__, e)
                ok = False
        if not ok:
            _SYMMETRIC[key] = None
    return _SYMMETRIC[key] is not None


def wire(point, a: torch.Tensor, group: str, tp: int, *, oneshot_max_bytes: int = ONESHOT_MAX_BYTES,
         count=None) -> dict:
    """Keyword arguments for a fused residual kernel (``point``: TP > 1) that sum ``a`` over the TP group:
    ``a`` itself and every communication argument (see the module docstring for the wirings)."""
    from .runtime import _reduce, emulating

    m, d = a.shape
    if point.c["TP"] != tp:
        raise CommError(f"{point.name} sums over {point.c['TP']} ranks, the group has {tp}; a binding bug")
    if emulating(tp):
        return _local(a.device).args(a, tp)
    if m * d * a.element_size() <= oneshot_max_bytes and symmetric_available(group, tp, a.device):
        out = _SYMMETRIC[group, tp, str(a.device)].args(m, d)
        out["a"] = a
        if count:
            count("collective:one_shot")
        return out
    return _local(a.device).args(_reduce(a.contiguous(), group, tp), tp)


def _local(device) -> _Local:
    key = str(device)
    if key not in _LOCAL:
        _LOCAL[key] = _Local(device)
    return _LOCAL[key]
