"""fuse_elementwise: activations, norms, the decay up-projection and expert selection folded into the
kernels next to them::

    before                                            after
    ------                                            -----
    h = k3.situ_glu(gate, up)                         d = k3.situ_linear(gate, up, W[down])
    d = k3.linear(h, W[down])

    n = k3.rms_norm(c, W[q_a_layernorm], 1e-6)        q = k3.rms_norm_linear(c, W[q_a_layernorm], 1e-6, W[q_b])
    q = k3.linear(n, W[q_b])

    f = k3.linear(fa, W[f_b])                         o = k3.kda_decode_fb(q, k, v, fa, W[f_b], ...)
    o = k3.kda_decode(q, k, v, f, ...)

    w, ids = k3.moe_select(lg, bias, k, ...)          e = k3.routed_experts(z, lg, bias, k, ..., W[experts])
    e = k3.latent_moe_experts(z, w, ids, ...)

    c = k3.rms_norm(kv[:, :C], W[kv_a_layernorm])     o, row = k3.mla_decode_latent(q, kv, W[kv_a_layernorm],
    row = torch.cat([c, kv[:, C:]])                            1e-6, gate, S[cache], lengths, W[kv_b], ...)
    o = k3.mla_decode(q, row, gate, S[cache], ...)

(Residual adds were folded by fuse_oproj_allreduce; SiTU inside the experts is part of the expert op.)
"""

from __future__ import annotations

import operator

import torch.fx

from k3compile import dialect
from k3compile.pipeline import K3Pass, PassContext, PassResult, Stage, register_pass

from .common import getitem_users, new_op, only_user, replace_node, tuple_outputs, val


def _mla_latent(latent):
    """(cat, rms_norm, kv) if ``latent = cat([rms_norm(kv[:, :C]), kv[:, C:]])``, else None."""
    if latent.op != "call_function" or getattr(latent.target, "__name__", "") != "cat":
        return None
    parts = latent.args[0]
    if len(parts) != 2 or not dialect.is_k3(parts[0], "rms_norm"):
        return None
    c_slice, pe_slice = parts[0].args[0], parts[1]
    if not all(isinstance(p, torch.fx.Node) and p.target is operator.getitem for p in (c_slice, pe_slice)):
        return None
    if c_slice.args[0] is not pe_slice.args[0] or len(c_slice.users) != 1:
        return None
    return latent, parts[0], c_slice.args[0]


@register_pass
class FuseElementwise(K3Pass):
    name = "fuse_elementwise"
    stage = Stage.FUSE

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        g = gm.graph
        count = 0
        for n in list(g.nodes):
            if dialect.is_k3(n, "situ_glu") and dialect.is_k3(only_user(n), "linear") and only_user(n).args[0] is n:
                lin = only_user(n)
                gate, up, beta, lb = n.args
                fused = new_op(gm, lin, "situ_linear", (gate, up, lin.args[1], beta, lb), [n, lin], self.name, lin)
                replace_node(lin, fused)
                g.erase_node(n)
                count += 1
            elif dialect.is_k3(n, "rms_norm") and dialect.is_k3(only_user(n), "linear") and only_user(n).args[0] is n:
                lin = only_user(n)
                x, w, eps = n.args
                fused = new_op(gm, lin, "rms_norm_linear", (x, w, eps, lin.args[1]), [n, lin], self.name, lin)
                replace_node(lin, fused)
                g.erase_node(n)
                count += 1
        for kda in [n for n in g.nodes if dialect.is_k3(n, "kda_decode")]:
            f = kda.args[3]
            if not (dialect.is_k3(f, "linear") and len(f.users) == 1):
                continue
            args = kda.args[:3] + (f.args[0], f.args[1]) + kda.args[4:]
            fused = new_op(gm, kda, "kda_decode_fb", args, [f, kda], self.name, kda)
            replace_node(kda, fused)
            g.erase_node(f)
            count += 1
        for mla in [n for n in g.nodes if dialect.is_k3(n, "mla_decode")]:
            fold = _mla_latent(mla.args[1])
            if fold is None:
                continue
            cat, norm, kv = fold
            q, _, gate, cache, lengths, kv_b, nope, vdim, scale = mla.args
            fused = new_op(gm, mla, "mla_decode_latent",
                           (q, kv, norm.args[1], norm.args[2], gate, cache, lengths, kv_b, nope, vdim, scale),
                           [norm, cat, mla], self.name)
            o, latent = tuple_outputs(gm, fused, [val(mla), val(cat)])
            mla.replace_all_uses_with(o)
            g.erase_node(mla)
            cat.replace_all_uses_with(latent)
            for n in (cat, norm, norm.args[0]):
                if not n.users:
                    g.erase_node(n)
            count += 1
        for experts in [n for n in g.nodes if dialect.is_k3(n, "latent_moe_experts")]:
            z, w_node, ids_node = experts.args[:3]
            sel = w_node.args[0] if w_node.op == "call_function" and w_node.args else None
            if not dialect.is_k3(sel, "moe_select") or ids_node.args[0] is not sel:
                continue
            users = getitem_users(sel)
            if any(set(u.users) != {experts} for u in users.values()):
                continue  # routing consumed elsewhere: keep the selection as its own op
            logits, bias, k, renorm, scale = sel.args
            args = (z, logits, bias, k, renorm, scale) + experts.args[3:]
            fused = new_op(gm, experts, "routed_experts", args, [sel, experts], self.name, experts)
            replace_node(experts, fused)
            for u in users.values():
                g.erase_node(u)
            g.erase_node(sel)
            count += 1
        return PassResult(match_count=count, changed=count > 0)

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        for n in gm.graph.nodes:
            if dialect.is_k3(n, "situ_glu") and dialect.is_k3(only_user(n), "linear"):
                raise self.fail("ensures", f"{n.name}: situ_glu -> linear left unfused")
