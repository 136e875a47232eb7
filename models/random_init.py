"""A random-weight model built directly on a device: real-dimension slices for benchmarks.

``save_random_checkpoint`` writes the full, unsharded model through the CPU (exact, seeded by tensor
name; what the tests use). At real dimensions that is minutes of CPU time and gigabytes of disk per
layer, for weights whose values a benchmark does not care about beyond their statistics. This fills a
model (any TP shard) in place on its device with the same statistics as the checkpoint's initialisation
(``checkpoint._random_tensor``): linear weights N(0, 1/fan_in), norms 1 + N(0, 0.1), ``A_log`` =
log U(1, 16), ``dt_bias`` = -3 + N(0, 0.5), routing bias N(0, 0.05), MXFP4 experts with uniformly random
FP4 codes and the E8M0 scale that gives each row a standard deviation of about 1/sqrt(fan_in).
"""

from __future__ import annotations

import math

import torch

from .config import K3Config
from .model import K3Model


def random_model(config: K3Config, *, tp_rank: int = 0, tp_size: int = 1, device="cuda", seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> K3Model:
    model = K3Model(config, dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            _fill(name, t, g)
    return model.eval()


# FP4 E2M1 code magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: RMS over uniformly random codes
_FP4_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)


def _fill(name: str, t: torch.Tensor, g: torch.Generator) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if t.dtype == torch.uint8:
        if name.endswith("_packed"):
            t.copy_(torch.randint(0, 256, t.shape, generator=g, device=t.device, dtype=torch.int32))
        else:  # E8M0 scale per 32 codes: 2^(s-127) * FP4 RMS ~ 1/sqrt(fan_in)
            fan_in = t.shape[-1] * 32
            t.fill_(127 + round(math.log2(1 / (math.sqrt(fan_in) * _FP4_RMS))))
        return
    if leaf == "A_log":
        t.copy_(torch.empty(t.shape, device=t.device).uniform_(1.0, 16.0, generator=g).log())
    elif leaf == "dt_bias":
        t.copy_(-3.0 + 0.5 * torch.randn(t.shape, generator=g, device=t.device))
    elif leaf == "e_score_correction_bias":
        t.copy_(0.05 * torch.randn(t.shape, generator=g, device=t.device))
    elif t.dim() == 1:  # norm weights
        t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g, device=t.device))
    else:  # linear / conv weights: fan-in is everything but the first dim
        fan_in = t[0].numel()
        t.copy_(torch.randn(t.shape, generator=g, device=t.device) / math.sqrt(fan_in))
