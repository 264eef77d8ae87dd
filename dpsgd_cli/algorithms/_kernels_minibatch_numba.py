"""The numba code of kernels_minibatch (imported on first use: numba is optional). Module-level functions, so
numba's on-disk cache finds them again (a closure over another jitted function gets a new cache key per process).
"""

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

PAIRS = 4  # (row, cell) dot products mb_logreg computes together
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
def dots8(typingctx, X, rows, V, cells, r, d, out):
    """dots8(X, rows, V, cells, r, d, out): out[k] = Σ_j X[rows[k], j] V[cells[k], r, j] for the PAIRS pairs k, each
    in a fixed order: lane p of an 8-wide vector accumulator sums the j ≡ p (mod 8) of the whole blocks of 8, then
    a fixed tree ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then the tail j ≥ 8⌊d/8⌋ one by one. The pairs'
    accumulators advance together (independent chains in flight: one pair's sum alone is bound by the add's
    latency). LLVM's vector type because the loop vectorizer may not reassociate a reduction (no fast-math here)
    and the SLP vectorizer did not pack the scalar chains; plain fmul and fadd, no FMA contraction: each lane's sum
    is the scalar sequence s_p += x·v whatever the vector width, and out[k] does not depend on the other pairs."""
    ok = (isinstance(X, types.Array) and isinstance(V, types.Array) and X.ndim == 2 and V.ndim == 3
          and X.layout == "C" and V.layout == "C" and X.dtype == types.float64 and V.dtype == types.float64
          and isinstance(out, types.Array) and out.dtype == types.float64 and out.layout == "C"
          and all(isinstance(a, types.Array) and a.dtype == types.int64 and a.layout == "C" for a in (rows, cells)))
    if not ok:
        return None

    def codegen(context, builder, signature, args):
        xty, rty, vty, cty, r_ty, d_ty, oty = signature.args
        x_arr, rows_arr, v_arr, cells_arr, r, d, out_arr = args
        i64, i32, f64 = ir.IntType(64), ir.IntType(32), ir.DoubleType()
        vec = ir.VectorType(f64, 8)
        r, d = context.cast(builder, r, r_ty, types.int64), context.cast(builder, d, d_ty, types.int64)
        zero = ir.Constant(i64, 0)
        xa, va = context.make_array(xty)(context, builder, x_arr), context.make_array(vty)(context, builder, v_arr)
        ra, ca = context.make_array(rty)(context, builder, rows_arr), context.make_array(cty)(context, builder, cells_arr)
        oa = context.make_array(oty)(context, builder, out_arr)
        px, pv = [], []
        for k in range(PAIRS):
            kk = ir.Constant(i64, k)
            i = builder.load(cgutils.get_item_pointer(context, builder, rty, ra, [kk], wraparound=False))
            c = builder.load(cgutils.get_item_pointer(context, builder, cty, ca, [kk], wraparound=False))
            px.append(cgutils.get_item_pointer(context, builder, xty, xa, [i, zero], wraparound=False))
            pv.append(cgutils.get_item_pointer(context, builder, vty, va, [c, r, zero], wraparound=False))
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 8)) for _ in range(PAIRS)]
        blocks = builder.sdiv(d, ir.Constant(i64, 8))
        with cgutils.for_range(builder, blocks) as loop:
            j = builder.mul(loop.index, ir.Constant(i64, 8))
            for k in range(PAIRS):
                xv = builder.load(builder.bitcast(builder.gep(px[k], [j]), vec.as_pointer()), align=8)
                vv = builder.load(builder.bitcast(builder.gep(pv[k], [j]), vec.as_pointer()), align=8)
                builder.store(builder.fadd(builder.load(accs[k]), builder.fmul(xv, vv)), accs[k])
        start = builder.mul(blocks, ir.Constant(i64, 8))
        totals = []
        for k in range(PAIRS):
            v = builder.load(accs[k])
            lane = [builder.extract_element(v, ir.Constant(i32, p)) for p in range(8)]
            s = builder.fadd(builder.fadd(builder.fadd(lane[0], lane[1]), builder.fadd(lane[2], lane[3])),
                             builder.fadd(builder.fadd(lane[4], lane[5]), builder.fadd(lane[6], lane[7])))
            totals.append(cgutils.alloca_once_value(builder, s))
        with cgutils.for_range(builder, builder.sub(d, start)) as loop:
            j = builder.add(start, loop.index)
            for k in range(PAIRS):
                x, v = builder.load(builder.gep(px[k], [j])), builder.load(builder.gep(pv[k], [j]))
                builder.store(builder.fadd(builder.load(totals[k]), builder.fmul(x, v)), totals[k])
        for k in range(PAIRS):
            builder.store(builder.load(totals[k]),
                          cgutils.get_item_pointer(context, builder, oty, oa, [ir.Constant(i64, k)], wraparound=False))
        return context.get_dummy_value()

    return types.void(X, rows, V, cells, r, d, out), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _pairs(TH, active, X, y, x_norm, clip, do_clip, r, d, rows, cells, n, z, g):  # pragma: no cover
    """The first n of the PAIRS pending (row, cell) pairs, in order: a = −y σ(−y θ_c·x_i), clipped, g_c += a x_i."""
    dots8(X, rows, TH, cells, r, d, z)
    for k in range(n):
        i, c = rows[k], cells[k]
        yi = y[i]
        a = -yi * (1.0 / (1.0 + np.exp(yi * z[k])))  # −y σ(−y θ·x)
        if do_clip[c]:
            a = a * clip[c] / max(abs(a) * x_norm[i], clip[c])
        for j in range(d):
            g[c, j] += a * X[i, j]


@numba.njit(cache=True, nogil=True)
def mb_logreg(TH, active, X, y, x_norm, idx, full, noise, slot, std, scale, l2, clip, do_clip, lrs, radius,
              do_project, g):  # pragma: no cover
    C, R, d = TH.shape
    m = lrs.shape[1]
    M = X.shape[0] if full else idx.shape[2]
    rows = np.zeros(PAIRS, dtype=np.int64)
    cells = np.zeros(PAIRS, dtype=np.int64)
    z = np.empty(PAIRS)
    n = 0
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
                for c in range(C):
                    if not active[c]:
                        continue
                    rows[n] = i
                    cells[n] = c
                    n += 1
                    if n == PAIRS:
                        _pairs(TH, active, X, y, x_norm, clip, do_clip, r, d, rows, cells, n, z, g)
                        n = 0
            if n > 0:  # the last pairs of the step; the unused slots repeat a pair (computed, not applied)
                for k in range(n, PAIRS):
                    rows[k] = rows[0]
                    cells[k] = cells[0]
                _pairs(TH, active, X, y, x_norm, clip, do_clip, r, d, rows, cells, n, z, g)
                n = 0
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
