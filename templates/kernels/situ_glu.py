"""SiTU-GLU of [M, K] bf16 rows: h = bf16(BETA*tanh(g/BETA)*sigmoid(g) * LINEAR_BETA*tanh(u/LINEAR_BETA)).

Grid (CTAS, M): each thread owns one vector of 8 consecutive elements (128-bit loads and store); fp32 math
with the same fast-math exp/tanh as the GEMV's situ prologue (kernels/gemv.py), so the two agree bit for
bit. Elementwise: nothing is reduced, so the result does not depend on the bucket.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

# >>> constants
# (example values: rendering replaces this block)
M = 2  # rows (the batch bucket)
K = 512  # row length
BETA = 4.0  # SiTU gate beta
LINEAR_BETA = 25.0  # SiTU linear beta
THREADS = 64  # threads per CTA (8 elements each)
# <<< constants

VEC = 8
VECS = K // VEC
CTAS = (VECS + THREADS - 1) // THREADS


class Kernel:
    @cute.jit
    def __call__(self, mG: cute.Tensor, mU: cute.Tensor, mH: cute.Tensor, stream):
        self.kernel(mG, mU, mH).launch(grid=(CTAS, M, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mU: cute.Tensor, mH: cute.Tensor):
        v = cute.arch.block_idx()[0] * THREADS + cute.arch.thread_idx()[0]
        m = cute.arch.block_idx()[1]
        rG = cute.make_rmem_tensor((VEC,), BFloat16)
        rU = cute.make_rmem_tensor((VEC,), BFloat16)
        rH = cute.make_rmem_tensor((VEC,), BFloat16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now
        if v < VECS:
            cute.autovec_copy(cute.local_tile(mG[m, None], (VEC,), (v,)), rG)
            cute.autovec_copy(cute.local_tile(mU[m, None], (VEC,), (v,)), rU)
            g = rG.load().to(Float32)
            u = rU.load().to(Float32)
            sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g, fastmath=True))
            act = Float32(BETA) * cute.math.tanh(g * Float32(1.0 / BETA), fastmath=True) * sig
            lin = Float32(LINEAR_BETA) * cute.math.tanh(u * Float32(1.0 / LINEAR_BETA), fastmath=True)
            rH.store((act * lin).to(BFloat16))
            cute.autovec_copy(rH, cute.local_tile(mH[m, None], (VEC,), (v,)))
