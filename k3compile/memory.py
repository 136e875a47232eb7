"""GPU memory one TP rank needs for the model and a bucket's decode state, from the config alone.

The model is built on the meta device (shapes, no weights), so this answers "does TP 4 of the real config fit
an H200?" on any machine in a fraction of a second. Counted, per rank:

* ``bf16``: the parameters (projections, norms, the embedding and lm_head shards), as the model holds them;
* ``experts``: the routed experts' MXFP4 codes and E8M0 scales (buffers);
* ``relaid``: the codes again, in the expert kernels' own layout (``mxfp4_mirror.prepack``). The runtime converts
  each expert weight at the first step and keeps the copy beside the checkpoint's (``runtime.relaid_bytes``);
  with the compile option ``relay_in_place`` (``relay_in_place=True`` here) it rewrites the codes in their own
  memory instead and this is 0: one copy of the experts, as a deployment holds them;
* ``state``: the decode state of ``bucket`` sequences with room for ``max_context`` positions (the MLA latent
  caches, the KDA conv and recurrent states).

Not counted: the runtime's workspaces, communication buffers and CUDA-graph pools (``k3compile bench`` measures
them as "extra memory": 64-354 MB on 4-layer slices at TP 8 and TP 2, BENCHMARKS.md 2026-12-05).
"""

from __future__ import annotations

import dataclasses

import torch

from .compiler import SUPPORTED_TP

H200_BYTES = 141e9  # one H200's memory (bytes); an H100 has 80e9


@dataclasses.dataclass(frozen=True)
class RankMemory:
    config: str
    tp: int
    bucket: int
    max_context: int
    bf16: int
    experts: int
    relaid: int
    state: int
    relay_in_place: bool = False

    @property
    def total(self) -> int:
        return self.bf16 + self.experts + self.relaid + self.state

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}

    def text(self) -> str:
        gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
        relaid = ("(the experts' codes relaid in place: relay_in_place)" if self.relay_in_place else
                  "(the experts' codes relaid for the kernels at the first step, a copy)")
        line = (f"memory per rank ({self.config}, TP{self.tp}, bucket {self.bucket}, room for {self.max_context} "
                f"positions): {gb(self.total)} GB = weights {gb(self.bf16)} (bf16) + {gb(self.experts)} (MXFP4 "
                f"experts) + {gb(self.relaid)} {relaid} + decode state {gb(self.state)}; workspaces and CUDA-graph "
                f"pools not counted")
        if self.total > H200_BYTES:
            fixes = ([f"relay_in_place (the compile option; plan --relay-in-place: {gb(self.relaid)} GB less)"]
                     if self.relaid else []) + (["a larger TP size"] if self.tp < max(SUPPORTED_TP) else []) + [
                "fewer layers (--config slice:N)", "a smaller bucket or --max-context"]
            line += f"\n  more than one H200 holds ({H200_BYTES / 1e9:.0f} GB): use {', '.join(fixes)}"
        return line


def rank_memory(config, *, tp: int, bucket: int, max_context: int | None = None,
                relay_in_place: bool = False) -> RankMemory:
    """The memory of rank 0 of ``tp`` (every rank holds the same shard sizes) for ``bucket`` sequences with room
    for ``max_context`` positions (default: the config's max_position_embeddings); ``relay_in_place``: compiled
    with that option (no relaid copy)."""
    from .models import K3Model

    config.check_tp(tp)
    if not isinstance(bucket, int) or bucket < 1:
        raise ValueError(f"bucket={bucket!r} must be a positive int (the batch size the state holds)")
    ctx = config.max_position_embeddings if max_context is None else max_context
    model = K3Model(config, dtype=torch.bfloat16, device="meta", tp_rank=0, tp_size=tp)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    expert = {n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith("experts_")}
    experts = sum(nbytes(b) for b in expert.values())
    bf16 = sum(nbytes(t) for t in (*model.parameters(), *model.buffers())) - experts
    # the kernels relay the routed experts' codes (``Arg.layout``: experts_w{1,3,2}_packed), not their scales
    relaid = 0 if relay_in_place else sum(nbytes(b) for n, b in expert.items() if n.endswith("_packed"))
    state = sum(nbytes(t) for t in model.new_state(bucket, ctx).tensors())  # checks ctx against the config
    return RankMemory(config.name, tp, bucket, ctx, bf16, experts, relaid, state, bool(relay_in_place))
