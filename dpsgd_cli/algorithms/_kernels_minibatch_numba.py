"""The numba code of the mini-batch backend (backends.py; imported on first use: numba is optional).
Module-level functions, so numba's on-disk cache finds them again (a closure over another jitted function gets a
new cache key per process).
"""

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from dpsgd_cli.algorithms._tail_numba import adaptive_release, fixed_rows, tail
from dpsgd_cli.models._logreg_numba import clip_residual, residual_from_exp

# (row, cell) pairs the pair path takes together: their dots 8 at a time (`dots8`, `sparse_dots8`: 8 chains of adds
# in flight), then their residuals in vector lanes (exp_fixed's latency once per PAIRS pairs, not per 8); measured
# best of 8/16/32/64 on adult.
PAIRS = 16
AHEAD = 4  # the batch row prefetched this many places ahead (random rows are latency-bound)


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


def _vec8(builder, ptr):
    """The 8 doubles at ptr as one LLVM vector (unaligned load)."""
    return builder.load(builder.bitcast(ptr, ir.VectorType(ir.DoubleType(), 8).as_pointer()), align=8)


def _splat8(builder, x):
    """x in all 8 lanes."""
    vec = ir.VectorType(ir.DoubleType(), 8)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8)
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), zeros)


def _lane_args(context, builder, signature, args, names):
    """Each argument as a C array struct or an int64 value, by name."""
    out = {}
    for name, ty, val in zip(names, signature.args, args):
        out[name] = (context.make_array(ty)(context, builder, val), ty) if isinstance(ty, types.Array) \
            else context.cast(builder, val, ty, types.int64)
    return out


def _ptr(context, builder, arr, *index):
    """The address of arr[index] (an `_lane_args` array; indices LLVM values or Python ints; no bounds check)."""
    a, ty = arr
    i64 = ir.IntType(64)
    return cgutils.get_item_pointer(context, builder, ty, a, [v if isinstance(v, ir.Value) else ir.Constant(i64, v)
                                                               for v in index], wraparound=False)


def _tree8(builder, s):
    """((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)): the fixed tree over the eight partial sums."""
    return builder.fadd(builder.fadd(builder.fadd(s[0], s[1]), builder.fadd(s[2], s[3])),
                        builder.fadd(builder.fadd(s[4], s[5]), builder.fadd(s[6], s[7])))


def _c_float_arrays(*arrays):
    """Whether all are C-contiguous float64 arrays (what the intrinsics' pointer arithmetic assumes)."""
    return all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float64 for a in arrays)


@intrinsic
def dots8(typingctx, X, rows, V, cells, r, d, b, out):
    """dots8(X, rows, V, cells, r, d, b, out): out[k] = Σ_j X[rows[k], j] V[cells[k], r, j] for the 8 pairs k = b …
    b + 7, each
    in a fixed order: lane p of an 8-wide vector accumulator sums the j ≡ p (mod 8) of the whole blocks of 8,
    then a fixed tree ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then the tail j ≥ 8⌊d/8⌋ one by one. The pairs'
    accumulators advance together (independent chains in flight: one pair's sum alone is bound by the add's
    latency). LLVM's vector type because the loop vectorizer may not reassociate a reduction (no fast-math here)
    and the SLP vectorizer did not pack the scalar chains; plain fmul and fadd, no FMA contraction: each lane's sum
    is the scalar sequence s_p += x·v whatever the vector width, and out[k] does not depend on the other pairs."""
    if not (_c_float_arrays(X, V, out) and X.ndim == 2 and V.ndim == 3
            and all(isinstance(a, types.Array) and a.dtype == types.int64 and a.layout == "C" for a in (rows, cells))):
        return None

    def codegen(context, builder, signature, args):
        a = _lane_args(context, builder, signature, args, ("X", "rows", "V", "cells", "r", "d", "b", "out"))
        pairs = [builder.add(a["b"], ir.Constant(ir.IntType(64), k)) for k in range(8)]
        i64, i32 = ir.IntType(64), ir.IntType(32)
        vec = ir.VectorType(ir.DoubleType(), 8)
        px = [_ptr(context, builder, a["X"], builder.load(_ptr(context, builder, a["rows"], pairs[k])), 0)
              for k in range(8)]
        pv = [_ptr(context, builder, a["V"], builder.load(_ptr(context, builder, a["cells"], pairs[k])), a["r"], 0)
              for k in range(8)]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 8)) for _ in range(8)]
        blocks = builder.sdiv(a["d"], ir.Constant(i64, 8))
        with cgutils.for_range(builder, blocks) as loop:
            j = builder.mul(loop.index, ir.Constant(i64, 8))
            for k in range(8):
                product = builder.fmul(_vec8(builder, builder.gep(px[k], [j])), _vec8(builder, builder.gep(pv[k], [j])))
                builder.store(builder.fadd(builder.load(accs[k]), product), accs[k])
        totals = []
        for k in range(8):
            v = builder.load(accs[k])
            totals.append(cgutils.alloca_once_value(builder, _tree8(builder, [
                builder.extract_element(v, ir.Constant(i32, p)) for p in range(8)])))
        start = builder.mul(blocks, ir.Constant(i64, 8))
        with cgutils.for_range(builder, builder.sub(a["d"], start)) as loop:
            j = builder.add(start, loop.index)
            for k in range(8):
                x, v = builder.load(builder.gep(px[k], [j])), builder.load(builder.gep(pv[k], [j]))
                builder.store(builder.fadd(builder.load(totals[k]), builder.fmul(x, v)), totals[k])
        for k in range(8):
            builder.store(builder.load(totals[k]), _ptr(context, builder, a["out"], pairs[k]))
        return context.get_dummy_value()

    return types.void(X, rows, V, cells, r, d, b, out), codegen


@intrinsic
def lane_dots2(typingctx, X, i0, i1, TT, cb, d, Z):
    """lane_dots2(X, i0, i1, TT, cb, d, Z): Z[q, cb + l] = Σ_j X[i_q, j] TT[j, cb + l] for the rows i0, i1 (q = 0, 1)
    and the 8 cells (lanes) l of the block at column cb of TT (θ by feature × cell). Each lane's sum in dot8's order
    (`dots8`): partial sums s_p over the j ≡ p (mod 8) of the whole blocks of 8, the tree ((s0 + s1) + (s2 + s3))
    + ((s4 + s5) + (s6 + s7)), then the tail one by one — so a cell's number is the same in a lane of any block
    as on the pair path. Plain fmul and fadd (no FMA contraction)."""
    if not (_c_float_arrays(X, TT, Z) and X.ndim == 2 and TT.ndim == 2 and Z.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        a = _lane_args(context, builder, signature, args, ("X", "i0", "i1", "TT", "cb", "d", "Z"))
        i64 = ir.IntType(64)
        vec = ir.VectorType(ir.DoubleType(), 8)
        width = cgutils.unpack_tuple(builder, a["TT"][0].shape, 2)[1]
        pt = _ptr(context, builder, a["TT"], 0, a["cb"])
        px = [_ptr(context, builder, a["X"], a["i0"], 0), _ptr(context, builder, a["X"], a["i1"], 0)]
        acc = [[cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 8)) for _ in range(8)] for _ in range(2)]
        blocks = builder.sdiv(a["d"], ir.Constant(i64, 8))
        with cgutils.for_range(builder, blocks) as loop:
            j = builder.mul(loop.index, ir.Constant(i64, 8))
            for p in range(8):
                jp = builder.add(j, ir.Constant(i64, p))
                t = _vec8(builder, builder.gep(pt, [builder.mul(jp, width)]))
                for q in range(2):
                    x = _splat8(builder, builder.load(builder.gep(px[q], [jp])))
                    builder.store(builder.fadd(builder.load(acc[q][p]), builder.fmul(x, t)), acc[q][p])
        tot = []
        for q in range(2):
            s = [builder.load(acc[q][p]) for p in range(8)]
            tot.append(cgutils.alloca_once_value(builder, _tree8(builder, s)))
        start = builder.mul(blocks, ir.Constant(i64, 8))
        with cgutils.for_range(builder, builder.sub(a["d"], start)) as loop:
            j = builder.add(start, loop.index)
            t = _vec8(builder, builder.gep(pt, [builder.mul(j, width)]))
            for q in range(2):
                x = _splat8(builder, builder.load(builder.gep(px[q], [j])))
                builder.store(builder.fadd(builder.load(tot[q]), builder.fmul(x, t)), tot[q])
        for q in range(2):
            builder.store(builder.load(tot[q]), builder.bitcast(_ptr(context, builder, a["Z"], q, a["cb"]),
                                                               vec.as_pointer()), align=8)
        return context.get_dummy_value()

    return types.void(X, i0, i1, TT, cb, d, Z), codegen


@intrinsic
def lane_axpy2(typingctx, G, X, i0, i1, A, cb, d, two):
    """lane_axpy2(G, X, i0, i1, A, cb, d, two): G[j, cb + l] += A[0, cb + l] X[i0, j], then (when two) += A[1, cb + l]
    X[i1, j], for every feature j and the 8 lanes l of the block at cb: the rows added in batch order, one read and
    one write of G for both. Plain fmul and fadd."""
    if not (_c_float_arrays(G, X, A) and G.ndim == 2 and X.ndim == 2 and A.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        a = _lane_args(context, builder, signature, args, ("G", "X", "i0", "i1", "A", "cb", "d", "two"))
        vec = ir.VectorType(ir.DoubleType(), 8)
        width = cgutils.unpack_tuple(builder, a["G"][0].shape, 2)[1]
        pg = _ptr(context, builder, a["G"], 0, a["cb"])
        px = [_ptr(context, builder, a["X"], a["i0"], 0), _ptr(context, builder, a["X"], a["i1"], 0)]
        av = [_vec8(builder, _ptr(context, builder, a["A"], q, a["cb"])) for q in range(2)]
        is_two = builder.icmp_signed("!=", a["two"], ir.Constant(ir.IntType(64), 0))
        with builder.if_else(is_two) as (then, otherwise):
            for rows in ((then, 2), (otherwise, 1)):
                with rows[0], cgutils.for_range(builder, a["d"]) as loop:
                    j = loop.index
                    gp = builder.bitcast(builder.gep(pg, [builder.mul(j, width)]), vec.as_pointer())
                    g = builder.load(gp, align=8)
                    for q in range(rows[1]):
                        x = _splat8(builder, builder.load(builder.gep(px[q], [j])))
                        g = builder.fadd(g, builder.fmul(av[q], x))
                    builder.store(g, gp, align=8)
        return context.get_dummy_value()

    return types.void(G, X, i0, i1, A, cb, d, two), codegen


def _nonzeros_row(context, builder, P, i):
    """(the address of row i of a `RowNonzeros.packed` (n, 2K + 1) uint64 array P (an `_lane_args` array), K, the
    row's count) for an intrinsic: columns at [0, K), the values' bits at [K, 2K), the (padded) count at 2K."""
    row = _ptr(context, builder, P, i, 0)
    K = builder.sdiv(cgutils.unpack_tuple(builder, P[0].shape, 2)[1], ir.Constant(ir.IntType(64), 2))
    return row, K, builder.load(builder.gep(row, [builder.add(K, K)]))


def _nonzero(builder, row, K, k):
    """(column j, value x) of slot k of a `_nonzeros_row`."""
    return builder.load(builder.gep(row, [k])), builder.bitcast(builder.load(builder.gep(row, [builder.add(K, k)])),
                                                               ir.DoubleType())


def _is_row_nonzeros(P):
    return isinstance(P, types.Array) and P.ndim == 2 and P.layout == "C" and P.dtype == types.uint64


@intrinsic
def sparse_lane_dots(typingctx, P, i, TT, cb, Z):
    """sparse_lane_dots(P, i, TT, cb, Z): Z[cb + l] = Σ_j x_ij TT[j, cb + l] for the 8 lanes l of the block at cb,
    from row i's nonzeros (`RowNonzeros.packed` P: column order, zero-padded), summed one after the other in column
    order (`sparse_dots8`'s order for one θ: one accumulator, in a register; the row's padded slots add x·θ = ±0 to
    a sum that
    starts at +0, which changes nothing). Plain fmul and fadd (no FMA contraction)."""
    if not (_is_row_nonzeros(P) and _c_float_arrays(TT, Z) and TT.ndim == 2 and Z.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        a = _lane_args(context, builder, signature, args, ("P", "i", "TT", "cb", "Z"))
        vec = ir.VectorType(ir.DoubleType(), 8)
        width = cgutils.unpack_tuple(builder, a["TT"][0].shape, 2)[1]
        pt = _ptr(context, builder, a["TT"], 0, a["cb"])
        row, K, count = _nonzeros_row(context, builder, a["P"], a["i"])
        total = cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 8))
        with cgutils.for_range(builder, count) as loop:
            j, x = _nonzero(builder, row, K, loop.index)
            product = builder.fmul(_splat8(builder, x), _vec8(builder, builder.gep(pt, [builder.mul(j, width)])))
            builder.store(builder.fadd(builder.load(total), product), total)
        builder.store(builder.load(total), builder.bitcast(_ptr(context, builder, a["Z"], a["cb"]), vec.as_pointer()),
                      align=8)
        return context.get_dummy_value()

    return types.void(P, i, TT, cb, Z), codegen


@intrinsic
def sparse_dots8(typingctx, P, rows, V, cells, r, b, out):
    """sparse_dots8(P, rows, V, cells, r, b, out): out[b + k] = θ·x for the 8 pairs k (x row rows[b + k] of
    `RowNonzeros.packed` P, θ = V[cells[b + k], r]), each summed from 0 over the row's slots one after the other,
    in column order (`sparse_lane_dots`' order); the 8 sums advance together, slot by slot, up to the longest of the
    8 rows (a shorter row's
    slots beyond its count are zero padding: x θ = ±0, no change), so that 8 chains of adds are in flight, not one.
    Plain fmul and fadd."""
    if not (_is_row_nonzeros(P) and _c_float_arrays(V, out) and V.ndim == 3 and out.ndim == 1
            and all(isinstance(a, types.Array) and a.dtype == types.int64 and a.layout == "C" for a in (rows, cells))):
        return None

    def codegen(context, builder, signature, args):
        a = _lane_args(context, builder, signature, args, ("P", "rows", "V", "cells", "r", "b", "out"))
        i64 = ir.IntType(64)
        pairs = [builder.add(a["b"], ir.Constant(i64, k)) for k in range(8)]
        heads, longest = [], ir.Constant(i64, 0)
        for k in range(8):
            row, K, count = _nonzeros_row(context, builder, a["P"], builder.load(_ptr(context, builder, a["rows"],
                                                                                    pairs[k])))
            heads.append(row)
            longest = builder.select(builder.icmp_unsigned(">", count, longest), count, longest)
        thetas = [_ptr(context, builder, a["V"], builder.load(_ptr(context, builder, a["cells"], pairs[k])), a["r"], 0)
                  for k in range(8)]
        sums = [cgutils.alloca_once_value(builder, ir.Constant(ir.DoubleType(), 0.0)) for _ in range(8)]
        with cgutils.for_range(builder, longest) as loop:
            for k in range(8):
                j, x = _nonzero(builder, heads[k], K, loop.index)
                term = builder.fmul(x, builder.load(builder.gep(thetas[k], [j])))
                builder.store(builder.fadd(builder.load(sums[k]), term), sums[k])
        for k in range(8):
            builder.store(builder.load(sums[k]), _ptr(context, builder, a["out"], pairs[k]))
        return context.get_dummy_value()

    return types.void(P, rows, V, cells, r, b, out), codegen


@intrinsic
def sparse_lane_axpy(typingctx, G, P, i, A, cb):
    """sparse_lane_axpy(G, P, i, A, cb): G[j, cb + l] += A[cb + l] x_ij over row i's nonzeros (`RowNonzeros.packed`
    P) for the 8 lanes of the block at cb (a padded slot adds A·0 = ±0: no change for finite A; NaN A: the step's
    poison). Plain fmul and fadd, the same operations as `lane_axpy2` on the nonzero columns."""
    if not (_is_row_nonzeros(P) and _c_float_arrays(G, A) and G.ndim == 2 and A.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        a = _lane_args(context, builder, signature, args, ("G", "P", "i", "A", "cb"))
        vec = ir.VectorType(ir.DoubleType(), 8)
        width = cgutils.unpack_tuple(builder, a["G"][0].shape, 2)[1]
        pg = _ptr(context, builder, a["G"], 0, a["cb"])
        av = _vec8(builder, _ptr(context, builder, a["A"], a["cb"]))
        row, K, count = _nonzeros_row(context, builder, a["P"], a["i"])
        with cgutils.for_range(builder, count) as loop:
            j, x = _nonzero(builder, row, K, loop.index)
            gp = builder.bitcast(builder.gep(pg, [builder.mul(j, width)]), vec.as_pointer())
            builder.store(builder.fadd(builder.load(gp, align=8), builder.fmul(av, _splat8(builder, x))), gp, align=8)
        return context.get_dummy_value()

    return types.void(G, P, i, A, cb), codegen


@intrinsic
def _double_from_bits(typingctx, bits):
    """The float64 whose IEEE bits are the int64 `bits`."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(context.cast(builder, args[0], signature.args[0], types.int64), ir.DoubleType())

    return types.float64(bits), codegen


LN2_HI, LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # fdlibm's split of ln 2 (k·LN2_HI exact)
INV_LN2 = 1.44269504088896338700e+00


@numba.njit(cache=True, nogil=True, inline="always", error_model="numpy")
def exp_fixed(x):  # pragma: no cover
    """eˣ from +, −, ×, floor and a bit cast only (so LLVM can run it in vector lanes, and a lane's result is the same
    in any lane and in scalar code): x = k ln 2 + r (Cody–Waite, |r| ≤ ln 2 / 2), Taylor to r¹³ by Horner (error
    below 1e-17 relative), times 2ᵏ; x clamped to [−708, 709] (eˣ then 3e−308 … 8e307 where libm gives 0 or inf:
    σ's 1/(1 + eˣ) moves by < 1e−307); NaN stays NaN. Within 1 ulp of libm's exp (tested on [−708, 709])."""
    xc = min(max(x, -708.0), 709.0)
    k = np.floor(xc * INV_LN2 + 0.5)
    r = (xc - k * LN2_HI) - k * LN2_LO
    p = 1.0 / 6227020800.0
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    e = p * _double_from_bits((np.int64(k) + 1023) << 52)
    return e if x == x else x


@numba.njit(cache=True, nogil=True, inline="always", error_model="numpy")
def residual(yi, z, clip, do_clip, xn):  # pragma: no cover
    """(a, u): a = −y σ(−y z), the logistic loss's ∇ = a x, clipped to ‖a x‖ ≤ clip when do_clip; u = 1 when the
    unclipped ‖a x‖ = |a| ‖x‖ ≤ clip (the example the clip leaves as it is: an adaptive clip's count), else 0
    (`LogisticRegression.per_example_grad_norms`' norm; branch-free: lanes)."""
    a = residual_from_exp(yi, exp_fixed(yi * z))
    return (clip_residual(a, xn, clip) if do_clip else a), (1.0 if abs(a) * xn <= clip else 0.0)


@numba.njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _lanes(TT, active, X, P, y, x_norm, clip, do_clip, d, i0, i1, two, Z, A, G, bad,
           poison, unclipped):  # pragma: no cover
    """Rows i0 (and i1 when two) for every cell (lanes; active, clip, do_clip padded to them, padding inactive):
    dots 8 cells a block, a = −y σ(−y θ_c·x_i) clipped, G += a x 8 cells a block. Rows read densely from X or,
    when P has rows, by their nonzeros (`sparse_lane_dots`, `sparse_lane_axpy`: the dot in the nonzeros' column
    order), where a lane whose θ is not finite (`bad`) gets the NaN dot the dense rows give. `poison`: an active
    lane's residual was NaN (its
    sum is then NaN in every column, as densely a·0 = NaN). `unclipped`: += the rows the clip leaves as they are."""
    CP = TT.shape[1]
    sparse = P.shape[0] > 0
    for cb in range(0, CP, 8):
        if sparse:
            sparse_lane_dots(P, i0, TT, cb, Z[0])
            if two:
                sparse_lane_dots(P, i1, TT, cb, Z[1])
        else:
            lane_dots2(X, i0, i1, TT, cb, d, Z)
    for q in range(2 if two else 1):
        i = i0 if q == 0 else i1
        yi, xn = y[i], x_norm[i]
        zq, aq = Z[q], A[q]
        for c in range(CP):  # one loop over all lanes, 1-D: LLVM vectorizes it (exp_fixed included)
            a, u = residual(yi, np.nan if bad[c] else zq[c], clip[c], do_clip[c], xn)
            unclipped[c] += u if active[c] else 0.0  # a padding lane's c is a pair cell's: leave its count
            aq[c] = a if active[c] else 0.0
            poison[c] |= active[c] and a != a
    for cb in range(0, CP, 8):
        if sparse:
            sparse_lane_axpy(G, P, i0, A[0], cb)
            if two:
                sparse_lane_axpy(G, P, i1, A[1], cb)
        else:
            lane_axpy2(G, X, i0, i1, A, cb, d, 1 if two else 0)


@numba.njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _pairs(TH, X, P, y, x_norm, clip, do_clip, r, d, rows, cells, n, z, g, bad, poison, unclipped,
           scratch):  # pragma: no cover
    """The first n of the PAIRS pending (row, cell) pairs in order: a = −y σ(−y θ_c·x_i), clipped; g_c += a x_i.
    Rows dense or by their nonzeros (`sparse_dots8`; `bad`, `poison`, `unclipped` as in `_lanes`)."""
    sparse = P.shape[0] > 0
    m = 8 * ((n + 7) // 8)
    for b in range(0, m, 8):  # the unused slots up to a multiple of 8 repeat pair 0 (computed, not applied)
        if sparse:
            sparse_dots8(P, rows, TH, cells, r, b, z)
            for k in range(b, b + 8):
                if bad[cells[k]]:
                    z[k] = np.nan
        else:
            dots8(X, rows, TH, cells, r, d, b, z)
    yk, xk, ck, dk, ak, uk = scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], scratch[5]
    for k in range(m):  # gathered apart, so that the residuals below run in vector lanes (exp_fixed's latency
        i, c = rows[k], cells[k]  # once per PAIRS rows, not per row); the same bits in any lane
        yk[k], xk[k], ck[k], dk[k] = y[i], x_norm[i], clip[c], 1.0 if do_clip[c] else 0.0
    for k in range(m):
        ak[k], uk[k] = residual(yk[k], z[k], ck[k], dk[k] != 0.0, xk[k])
    for k in range(n):
        i, c, a = rows[k], cells[k], ak[k]
        poison[c] |= a != a
        unclipped[c] += uk[k]
        if sparse:
            K, count = _slots(P, i)
            for e in range(count):
                g[c, int(P[i, e])] += a * _double_from_bits(P[i, K + e])
        else:
            for j in range(d):
                g[c, j] += a * X[i, j]


@numba.njit(cache=True, nogil=True, inline="always")
def _slots(P, i):  # pragma: no cover
    """(K, row i's padded count) of a `RowNonzeros.packed` P: slot k's column P[i, k], its value's bits P[i, K + k]."""
    K = (P.shape[1] - 1) // 2
    return K, int(P[i, 2 * K])


@numba.njit(cache=True, nogil=True, inline="always")
def _finite(theta):  # pragma: no cover
    """Whether every entry of θ is finite (v − v is 0 for finite v, NaN for ±inf and NaN)."""
    ok = True
    for j in range(theta.shape[0]):
        ok &= theta[j] - theta[j] == 0.0
    return ok


@numba.njit(cache=True, nogil=True, error_model="numpy")
def mb_logreg(TH, active, X, P, y, x_norm, idx, noise, slot, clip, do_clip, codes, vals, lrs,
              lanes, M1, M2, counts, count_slot, adapt, fixed):  # pragma: no cover
    """Steps of every cell (TH: cell × replica × feature) on the batches idx, each cell's step ending in its tail
    program (codes[c], vals[c]; noise noise[slot[c]], none when slot[c] < 0; clip norm clip[c, r]). A cell with an
    adaptive clip (count_slot[c] ≥ 0: its count's noise counts[count_slot[c]], (m, R) a block; its fields adapt[c])
    gets its sum's noise and moves clip[c, r] in `adaptive_release` before its tail, from the step's count of
    unclipped examples (clip (C, R) is the norms' state across calls). The first
    `lanes` cells are vector lanes, 8 a block (θ by feature × cell, two rows at a time: `lane_dots2`,
    `lane_axpy2`); the others take the pair path, PAIRS (row, cell) pairs at a time (`dots8`). Both compute each
    cell's numbers in the same order: which cell takes which path changes nothing but the time. P: X's
    `RowNonzeros.packed` (then the rows are read by their nonzeros and a dot sums them in column order, the same on
    both paths: `_lanes`, `_pairs`; within ~1e-16 relative of the dense rows' order), or an empty (0, 0) uint64
    array (dense rows). M1, M2: the Adam moments of every (cell, replica), (C, R, d) (empty last axis: no Adam).
    fixed: the rows of fixed gradient (`models.base.FixedGradients`) as (row (n,), weight (R, m), idx, val, raw
    norm, proj (C, steps, R, m) out), row empty when there are none (`_tail_numba.fixed_rows`)."""
    C, R, d = TH.shape
    m = lrs.shape[1]
    M = idx.shape[2]
    sparse = P.shape[0] > 0
    scratch = np.zeros((6, PAIRS))  # the pairs' gathered y, ‖x‖, clip, do_clip, residuals and unclipped
    rows = np.zeros(PAIRS, dtype=np.int64)
    cells = np.zeros(PAIRS, dtype=np.int64)
    z = np.empty(PAIRS)
    CL = lanes
    CP = 8 * ((CL + 7) // 8)
    TT = np.zeros((d, CP))  # θ of the lane cells of replica r by feature × cell (padding cells 0); G their sums
    G = np.empty((d, CP))
    Z = np.empty((2, CP))
    A = np.empty((2, CP))
    g = np.empty((C, d))  # the pair cells' sums
    active_l, clip_l, do_clip_l = np.zeros(CP, dtype=np.bool_), np.ones(CP), np.zeros(CP, dtype=np.bool_)
    active_l[:CL] = active[:CL]  # the settings the lanes read, padded (padding lanes inactive)
    do_clip_l[:CL] = do_clip[:CL]
    bad = np.zeros(max(C, CP), dtype=np.bool_)  # sparse: θ not finite (lanes: lane c = cell c < CL)
    poison = np.zeros(max(C, CP), dtype=np.bool_)  # sparse: a NaN residual this step
    unclipped = np.zeros(max(C, CP))  # the examples of gradient norm ≤ the clip this step (adaptive clips' count)
    frow, fweight, fidx, fval, fraw, fproj = fixed
    has_fixed = frow.shape[0] > 0
    fcounts = np.zeros(fidx.shape[0])  # the step's rows of each fixed gradient
    for r in range(R):
        for c in range(CL):
            clip_l[c] = clip[c, r]
            for j in range(d):
                TT[j, c] = TH[c, r, j]
        clip_r = clip[:, r]
        if sparse:
            for c in range(C):
                bad[c] = not _finite(TH[c, r])
        for t in range(m):
            G[:, :] = 0.0
            g[:, :] = 0.0
            poison[:] = False
            unclipped[:] = 0.0
            fcounts[:] = 0.0
            n = 0
            kept = 0
            pending = -1  # lanes: a row waiting for its partner
            for k in range(M):
                i = idx[t, r, k]
                if i < 0:  # kept indices come first: the rest of the row is padding
                    break
                kept += 1
                if has_fixed and frow[i] >= 0:
                    fcounts[frow[i]] += 1.0
                if k + AHEAD < M:  # random rows: ask for a later row now (latency-bound otherwise)
                    ahead = idx[t, r, k + AHEAD]
                    if ahead >= 0:
                        if sparse:
                            for j in range(0, P.shape[1], 8):
                                prefetch(P, ahead, j)
                        else:
                            for j in range(0, d, 8):
                                prefetch(X, ahead, j)
                if CL > 0:
                    if pending < 0:
                        pending = i
                    else:
                        _lanes(TT, active_l, X, P, y, x_norm, clip_l, do_clip_l, d, pending, i, True, Z, A, G,
                               bad, poison, unclipped)
                        pending = -1
                for c in range(CL, C):
                    if not active[c]:
                        continue
                    rows[n] = i
                    cells[n] = c
                    n += 1
                    if n == PAIRS:
                        _pairs(TH, X, P, y, x_norm, clip_r, do_clip, r, d, rows, cells, n, z, g, bad, poison,
                               unclipped, scratch)
                        n = 0
            if pending >= 0:
                _lanes(TT, active_l, X, P, y, x_norm, clip_l, do_clip_l, d, pending, pending, False, Z, A, G,
                       bad, poison, unclipped)
            if n > 0:  # the last pairs of the step; the unused slots repeat a pair (computed, not applied)
                for k in range(n, PAIRS):
                    rows[k] = rows[0]
                    cells[k] = cells[0]
                _pairs(TH, X, P, y, x_norm, clip_r, do_clip, r, d, rows, cells, n, z, g, bad, poison,
                               unclipped, scratch)
            for c in range(C):
                if active[c]:
                    s = slot[c]
                    zc = noise[max(s, 0), min(t, noise.shape[1] - 1), min(r, noise.shape[2] - 1)]  # no noise: a dummy
                    if c < CL:
                        if poison[c]:  # a sparse step's NaN residual, which the dense sum spreads to every coordinate
                            G[:, c] = np.nan
                        if has_fixed:
                            fixed_rows(TT[:, c], G[:, c], fcounts, fweight[r], fidx, fval, fraw, clip[c, r], do_clip[c],
                                       fproj[c, t, r])
                        if count_slot[c] >= 0:
                            clip[c, r] = adaptive_release(G[:, c], zc, clip[c, r], unclipped[c], kept,
                                                          counts[count_slot[c], t, r], adapt[c])
                            clip_l[c] = clip[c, r]
                        tail(TT[:, c], G[:, c], codes[c], vals[c], zc, s >= 0, lrs[c, t], M1[c, r], M2[c, r])
                        bad[c] = sparse and not _finite(TT[:, c])
                    else:
                        if poison[c]:
                            g[c] = np.nan
                        if has_fixed:
                            fixed_rows(TH[c, r], g[c], fcounts, fweight[r], fidx, fval, fraw, clip[c, r], do_clip[c],
                                       fproj[c, t, r])
                        if count_slot[c] >= 0:  # clip_r, the pairs' norms, is this column of clip
                            clip[c, r] = adaptive_release(g[c], zc, clip[c, r], unclipped[c], kept,
                                                          counts[count_slot[c], t, r], adapt[c])
                        tail(TH[c, r], g[c], codes[c], vals[c], zc, s >= 0, lrs[c, t], M1[c, r], M2[c, r])
                        bad[c] = sparse and not _finite(TH[c, r])
        for c in range(CL):
            for j in range(d):
                TH[c, r, j] = TT[j, c]
    return TH
