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


@intrinsic
def dot8(typingctx, X, i, V, c, r, d):
    """dot8(X, i, V, c, r, d) = Σ_j X[i, j] V[c, r, j] in a fixed order: lane p of one 8-wide vector accumulator
    sums the j ≡ p (mod 8) of the whole blocks of 8 (eight independent chains, one vector add each per block), then a
    fixed tree ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then the tail j ≥ 8⌊d/8⌋ one by one. Written in
    LLVM's vector type because the loop vectorizer may not reassociate a reduction (no fast-math here: none is
    wanted) and the SLP vectorizer did not pack the eight scalar chains. Plain fmul and fadd, no FMA contraction:
    each lane's sum is the scalar sequence s_p += x·v, whatever the machine's vector width."""
    if not (isinstance(X, types.Array) and isinstance(V, types.Array) and X.ndim == 2 and V.ndim == 3
            and X.layout == "C" and V.layout == "C" and X.dtype == types.float64 and V.dtype == types.float64):
        return None

    def codegen(context, builder, signature, args):
        xty, _, vty, _, _, _ = signature.args
        x_arr, i, v_arr, c, r, d = args
        i64, f64 = ir.IntType(64), ir.DoubleType()
        vec = ir.VectorType(f64, 8)
        i, c, r, d = (context.cast(builder, v, t, types.int64) for v, t in
                      zip((i, c, r, d), (signature.args[1], signature.args[3], signature.args[4], signature.args[5])))
        zero = ir.Constant(i64, 0)
        xa, va = context.make_array(xty)(context, builder, x_arr), context.make_array(vty)(context, builder, v_arr)
        px = cgutils.get_item_pointer(context, builder, xty, xa, [i, zero], wraparound=False)
        pv = cgutils.get_item_pointer(context, builder, vty, va, [c, r, zero], wraparound=False)
        acc = cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 8))
        blocks = builder.sdiv(d, ir.Constant(i64, 8))
        with cgutils.for_range(builder, blocks) as loop:
            j = builder.mul(loop.index, ir.Constant(i64, 8))
            xv = builder.load(builder.bitcast(builder.gep(px, [j]), vec.as_pointer()), align=8)
            vv = builder.load(builder.bitcast(builder.gep(pv, [j]), vec.as_pointer()), align=8)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(xv, vv)), acc)
        v = builder.load(acc)
        lane = [builder.extract_element(v, ir.Constant(ir.IntType(32), k)) for k in range(8)]
        s = builder.fadd(builder.fadd(builder.fadd(lane[0], lane[1]), builder.fadd(lane[2], lane[3])),
                         builder.fadd(builder.fadd(lane[4], lane[5]), builder.fadd(lane[6], lane[7])))
        total = cgutils.alloca_once_value(builder, s)
        start = builder.mul(blocks, ir.Constant(i64, 8))
        with cgutils.for_range(builder, builder.sub(d, start)) as loop:
            j = builder.add(start, loop.index)
            x = builder.load(builder.gep(px, [j]))
            y = builder.load(builder.gep(pv, [j]))
            builder.store(builder.fadd(builder.load(total), builder.fmul(x, y)), total)
        return builder.load(total)

    return types.float64(X, i, V, c, r, d), codegen


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
