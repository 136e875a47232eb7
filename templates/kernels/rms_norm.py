"""RMSNorm over rows of a [M, N] bf16 activation (KimiRMSNorm: fp32 inside, rounded to bf16, times weight).

One CTA per row; each thread owns VEC = 8 consecutive elements per step (one 128-bit load), so a row of N
elements takes N / (8 * THREADS) steps. The sum of squares is reduced with a warp butterfly, then across
warps through shared memory. The row is read twice (the second read hits L1/L2): decode rows are a few KB.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32

# >>> constants
# (example values: rendering replaces this block)
M = 2  # rows (the batch bucket)
N = 256  # row length
EPS = 1e-05  # variance epsilon
THREADS = 32  # threads per CTA (one row per CTA)
# <<< constants

VEC = 8
WARPS = THREADS // 32
STEPS = N // (VEC * THREADS)


class Kernel:
    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream):
        self.kernel(mX, mW, mY).launch(grid=(M, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        row = cute.arch.block_idx()[0]
        smem = cutlass.utils.SmemAllocator()
        sPartial = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), 16)
        rX = cute.make_rmem_tensor((VEC,), mX.element_type)
        rW = cute.make_rmem_tensor((VEC,), mW.element_type)
        rY = cute.make_rmem_tensor((VEC,), mY.element_type)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now

        ss = Float32(0.0)
        for s in cutlass.range_constexpr(STEPS):
            cute.autovec_copy(cute.local_tile(mX[row, None], (VEC,), (s * THREADS + tid,)), rX)
            v = rX.load().to(Float32)
            ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        ss = cute.arch.warp_reduction(ss, operator.add)
        warp = cute.arch.warp_idx()  # a warp-wide shuffle: never call it from a divergent branch (deadlock)
        if cute.arch.lane_idx() == 0:
            sPartial[warp] = ss
        cute.arch.sync_threads()
        total = Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            total = total + sPartial[w]
        rstd = cute.math.rsqrt(total / Float32(N) + Float32(EPS))

        for s in cutlass.range_constexpr(STEPS):
            i = s * THREADS + tid
            cute.autovec_copy(cute.local_tile(mX[row, None], (VEC,), (i,)), rX)
            cute.autovec_copy(cute.local_tile(mW, (VEC,), (i,)), rW)
            normed = (rX.load().to(Float32) * rstd).to(mX.element_type)  # KimiRMSNorm rounds before the weight
            rY.store((normed.to(Float32) * rW.load().to(Float32)).to(mY.element_type))
            cute.autovec_copy(rY, cute.local_tile(mY[row, None], (VEC,), (i,)))
