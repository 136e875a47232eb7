"""Distributed shared memory (sm_90 thread-block clusters): loads from and stores to a peer CTA's shared memory,
shared by the clustered GEMV (its K split over a CTA pair), the MLA decode's combine kernel (its column split over
a cluster), the residual kernel's row statistics and the KDA decode's output norm (a head's columns over a
cluster). Templates that import this file list it in ``Template.libs``, so it is part of their kernels' identity."""

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def ld_dsmem_f32(addr, rank, *, loc=None, ip=None):
    """``ld.shared::cluster.f32``: the fp32 at shared address ``addr`` (this CTA's layout) of CTA ``rank`` of the
    cluster (``mapa`` maps the address)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 ra; mapa.shared::cluster.u32 ra, $1, $2; ld.shared::cluster.f32 $0, [ra]; }", "=f,r,r",
        has_side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def st_dsmem_f32(addr, rank, value, *, loc=None, ip=None):
    """``st.shared::cluster.f32``: ``value`` to the shared address ``addr`` (this CTA's layout) of CTA ``rank`` of
    the cluster (``mapa`` maps the address)."""
    llvm.inline_asm(res=None, operands_=[Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip),
                                         Float32(value).ir_value(loc=loc, ip=ip)],
                    asm_string=("{ .reg .b32 ra; mapa.shared::cluster.u32 ra, $0, $1; "
                                "st.shared::cluster.f32 [ra], $2; }"),
                    constraints="r,r,f", has_side_effects=True, loc=loc, ip=ip)
