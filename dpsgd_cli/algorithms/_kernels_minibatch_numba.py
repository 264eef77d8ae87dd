"""The numba code of kernels_minibatch (imported on first use: numba is optional). Module-level functions, so
numba's on-disk cache finds them again (a closure over another jitted function gets a new cache key per process).
"""

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

AHEAD = 4  # mb_logreg prefetches the batch row this many places ahead (random rows: measured 35 → 16 µs a step of dots)


@intrinsic
def prefetch(typingctx, arr, i, j):
    """prefetch(X, i, j): LLVM's prefetch of the cache line holding X[i, j] (a hint: no result, no fault)."""
    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1], args[2]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, i, j), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def dot8(X, i, V, c, r, d):  # pragma: no cover
    """Σ_j X[i, j] V[c, r, j] in a fixed order: eight interleaved partial sums (independent chains: the
    latency of one add no longer bounds the loop), a fixed tree, then the tail."""
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    s4 = 0.0
    s5 = 0.0
    s6 = 0.0
    s7 = 0.0
    j = 0
    while j + 8 <= d:
        s0 += X[i, j] * V[c, r, j]
        s1 += X[i, j + 1] * V[c, r, j + 1]
        s2 += X[i, j + 2] * V[c, r, j + 2]
        s3 += X[i, j + 3] * V[c, r, j + 3]
        s4 += X[i, j + 4] * V[c, r, j + 4]
        s5 += X[i, j + 5] * V[c, r, j + 5]
        s6 += X[i, j + 6] * V[c, r, j + 6]
        s7 += X[i, j + 7] * V[c, r, j + 7]
        j += 8
    s = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    while j < d:
        s += X[i, j] * V[c, r, j]
        j += 1
    return s

@numba.njit(cache=True, nogil=True)
def mb_logreg(TH, active, X, y, x_norm, idx, full, noise, slot, std, scale, l2, clip, do_clip, lrs, radius,
              do_project, g):  # pragma: no cover
    C, R, d = TH.shape
    m = lrs.shape[1]
    M = X.shape[0] if full else idx.shape[2]
    for r in range(R):
        for t in range(m):
            for c in range(C):
                for j in range(d):
                    g[c, j] = 0.0
            for k in range(M):
                i = k if full else idx[t, r, k]
                if i < 0:  # kept indices come first: the rest of the row is padding
                    break
                if not full and k + AHEAD < M:  # random rows: ask for a later row now (latency-bound otherwise)
                    ahead = idx[t, r, k + AHEAD]
                    if ahead >= 0:
                        for j in range(0, d, 8):
                            prefetch(X, ahead, j)
                yi = y[i]
                for c in range(C):
                    if not active[c]:
                        continue
                    a = -yi * (1.0 / (1.0 + np.exp(yi * dot8(X, i, TH, c, r, d))))  # −y σ(−y θ·x)
                    if do_clip[c]:
                        a = a * clip[c] / max(abs(a) * x_norm[i], clip[c])
                    for j in range(d):
                        g[c, j] += a * X[i, j]
            for c in range(C):
                if not active[c]:
                    continue
                eta = lrs[c, t]
                s = slot[c]
                sq = 0.0
                for j in range(d):
                    v = g[c, j]
                    if s >= 0:
                        v = v + std[c] * noise[s, t, r, j]
                    v = v * scale[c]
                    if l2[c] != 0.0:
                        v = v + l2[c] * TH[c, r, j]
                    v = TH[c, r, j] - eta * v
                    TH[c, r, j] = v
                    sq += v * v
                if do_project[c]:
                    f = radius[c] / max(np.sqrt(sq), 1e-300)
                    if f < 1.0:
                        for j in range(d):
                            TH[c, r, j] = TH[c, r, j] * f
    return TH
