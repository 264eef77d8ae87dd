"""numba code of the random streams: `streams.ReplicaStreams.normal`'s normals and the Poisson sampler's exponential
gaps (sampling.py), NumPy's numbers with PCG64 inlined (imported on first use: numba is optional)."""

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@numba.njit(cache=True, nogil=True)
def fill_normals(g, out, r):
    """out[k, r, :] ← the next K·P standard normals of generator g, in the order of `g.standard_normal((K, P))`
    (numba runs NumPy's ziggurat on g's own bit generator: the same numbers, written straight into the (K, R, P)
    block, without the per-replica arrays and their stacking)."""
    K, P = out.shape[0], out.shape[2]
    for k in range(K):
        for p in range(P):
            out[k, r, p] = g.standard_normal()


# --- the same numbers with PCG64 inlined ------------------------------------------------------------------------
# `fill_normals` calls g's bit generator through a function pointer per draw; here PCG64's step (numpy/random/src/
# pcg64: state ← state · M + inc mod 2¹²⁸, output XSL-RR) is inlined into NumPy's ziggurat (distributions.c,
# random_standard_normal, as numba transcribes it; its tables are numba's). The state is
# read from the generator once (`pcg64_state`) and then kept by the caller, who never draws from g again.
try:
    from numba.np.random._constants import (
        fe_double,
        fi_double,
        ke_double,
        ki_double,
        we_double,
        wi_double,
        ziggurat_exp_r,
        ziggurat_nor_inv_r,
        ziggurat_nor_r,
    )
    ZIGGURAT_TABLES = True
except Exception:  # another numba layout: the Generator path (`fill_normals`) only
    ZIGGURAT_TABLES = False

MULTIPLIER = 0x2360ED051FC65DA44385DF649FCCF645  # PCG_DEFAULT_MULTIPLIER_128
_LOW = (1 << 64) - 1


@intrinsic
def _pcg_step(typingctx, hi, lo, inc_hi, inc_lo):
    """(hi, lo) of (state · M + inc) mod 2¹²⁸, in LLVM's 128-bit integers (numba has none)."""
    u64 = types.uint64
    sig = types.UniTuple(u64, 2)(u64, u64, u64, u64)

    def codegen(context, builder, signature, args):
        i128, i64 = ir.IntType(128), ir.IntType(64)

        def wide(high, low):
            return builder.or_(builder.shl(builder.zext(high, i128), ir.Constant(i128, 64)), builder.zext(low, i128))

        s = builder.add(builder.mul(wide(args[0], args[1]), ir.Constant(i128, MULTIPLIER)), wide(args[2], args[3]))
        return context.make_tuple(builder, signature.return_type,
                                  (builder.trunc(builder.lshr(s, ir.Constant(i128, 64)), i64), builder.trunc(s, i64)))

    return sig, codegen


@numba.njit(inline="always")
def _xsl_rr(hi, lo):
    """PCG64's 64-bit output of a state: (hi ^ lo) rotated right by hi >> 58."""
    x = hi ^ lo
    rot = hi >> np.uint64(58)
    return (x >> rot) | (x << ((np.uint64(64) - rot) & np.uint64(63)))


@numba.njit(inline="always")
def _double(hi, lo):
    """PCG64's next_double from a state: the output's top 53 bits / 2⁵³."""
    return (_xsl_rr(hi, lo) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@numba.njit(cache=True, nogil=True)
def fill_normals_pcg64(state, out, r):
    """`fill_normals` for a PCG64 generator whose state is `state` (uint64 [state hi, state lo, inc hi, inc lo],
    `pcg64_state`; advanced in place): out[k, r, :] ← the next K·P standard normals, the numbers NumPy draws."""
    hi, lo, inc_hi, inc_lo = state[0], state[1], state[2], state[3]
    K, P = out.shape[0], out.shape[2]
    for k in range(K):
        for p in range(P):
            while True:
                hi, lo = _pcg_step(hi, lo, inc_hi, inc_lo)
                bits = _xsl_rr(hi, lo)
                idx = bits & np.uint64(0xff)
                bits >>= np.uint64(8)
                sign = bits & np.uint64(1)
                rabs = (bits >> np.uint64(1)) & np.uint64(0x000fffffffffffff)
                x = rabs * wi_double[idx]
                if sign:
                    x = -x
                if rabs < ki_double[idx]:  # 99.3% of the draws
                    break
                if idx == 0:  # the tail
                    while True:
                        hi, lo = _pcg_step(hi, lo, inc_hi, inc_lo)
                        xx = -ziggurat_nor_inv_r * np.log1p(-_double(hi, lo))
                        hi, lo = _pcg_step(hi, lo, inc_hi, inc_lo)
                        yy = -np.log1p(-_double(hi, lo))
                        if yy + yy > xx * xx:
                            break
                    x = -(ziggurat_nor_r + xx) if (rabs >> np.uint64(8)) & np.uint64(1) else ziggurat_nor_r + xx
                    break
                hi, lo = _pcg_step(hi, lo, inc_hi, inc_lo)
                if (fi_double[idx - 1] - fi_double[idx]) * _double(hi, lo) + fi_double[idx] < np.exp(-0.5 * x * x):
                    break
            out[k, r, p] = x
    state[0], state[1] = hi, lo


@numba.njit(inline="always")
def _exponential(hi, lo, inc_hi, inc_lo):
    """(x, hi, lo): the next standard exponential from PCG64's state (hi, lo) and the state after it: NumPy's
    ziggurat (distributions.c, random_standard_exponential, as numba transcribes it; its tables are numba's)."""
    while True:
        hi, lo = _pcg_step(hi, lo, inc_hi, inc_lo)
        ri = _xsl_rr(hi, lo) >> np.uint64(3)
        idx = ri & np.uint64(0xff)
        ri >>= np.uint64(8)
        x = ri * we_double[idx]
        if ri < ke_double[idx]:  # most draws: the box under the curve
            return x, hi, lo
        hi, lo = _pcg_step(hi, lo, inc_hi, inc_lo)
        if idx == 0:  # the tail
            return ziggurat_exp_r - np.log1p(-_double(hi, lo)), hi, lo
        if (fe_double[idx - 1] - fe_double[idx]) * _double(hi, lo) + fe_double[idx] < np.exp(-x):
            return x, hi, lo


@numba.njit(cache=True, nogil=True)
def fill_exponentials_pcg64(state, out):
    """out[:] ← the next standard exponentials of the PCG64 generator whose state is `state` (as
    `fill_normals_pcg64` takes it; advanced in place): the numbers of `Generator.standard_exponential`."""
    hi, lo, inc_hi, inc_lo = state[0], state[1], state[2], state[3]
    for i in range(out.size):
        out[i], hi, lo = _exponential(hi, lo, inc_hi, inc_lo)
    state[0], state[1] = hi, lo


@numba.njit(cache=True, nogil=True)
def poisson_block_pcg64(states, n, scale, out):
    """out[k, r, :] ← replica r's kept indices at step k, −1 past n (`sampling.poisson_indices` with the geometric
    gaps ⌈E / scale⌉, scale = −log1p(−q), of the exponentials E of the PCG64 state states[r], advanced in place);
    returns (K, R): whether a step's M gaps stayed below n (its row goes on: more gaps, drawn after the block's)."""
    K, R, M = out.shape
    short = np.zeros((K, R), dtype=np.bool_)
    for r in range(R):
        hi, lo, inc_hi, inc_lo = states[r, 0], states[r, 1], states[r, 2], states[r, 3]
        for k in range(K):
            at = np.int64(-1)
            for m in range(M):
                x, hi, lo = _exponential(hi, lo, inc_hi, inc_lo)
                at += np.int64(np.ceil(x / scale))
                out[k, r, m] = at if at < n else -1
            short[k, r] = at < n
        states[r, 0], states[r, 1] = hi, lo
    return short


# NumPy's seeding of `default_rng([seed, purpose])` (bit_generator.pyx, SeedSequence: O'Neill's seed_seq hashes,
# in 32-bit words; _pcg64.pyx and pcg64.c: PCG64 from its 4 uint64 words), for seed and purpose below 2³², where
# each is one word of entropy: the state without building the generator (tens of µs per replica)
_MASK32 = np.uint64(0xFFFFFFFF)
_INIT_A, _MULT_A = np.uint64(0x43b0d7e5), np.uint64(0x931e8875)
_INIT_B, _MULT_B = np.uint64(0x8b51f9dd), np.uint64(0x58f38ded)
_MIX_L, _MIX_R = np.uint64(0xca01f9dd), np.uint64(0x4973f715)


@numba.njit(inline="always")
def _hashmix(value, hash_const):
    """(mixed value, next hash constant): SeedSequence's hashmix on 32-bit words."""
    value ^= hash_const
    hash_const = (hash_const * _MULT_A) & _MASK32
    value = (value * hash_const) & _MASK32
    return value ^ (value >> np.uint64(16)), hash_const


@numba.njit(inline="always")
def _mix(x, y):
    result = (_MIX_L * x - _MIX_R * y) & _MASK32
    return result ^ (result >> np.uint64(16))


@numba.njit(cache=True, nogil=True)
def seeded_states(seeds, purpose, out):
    """out[r] ← the PCG64 state (as `pcg64_state` gives it) of `default_rng([seeds[r], purpose])`, every seed and
    the purpose in [0, 2³²)."""
    pool = np.zeros(4, dtype=np.uint64)
    for r in range(seeds.size):
        hash_const = _INIT_A
        for i in range(4):  # the entropy [seed, purpose], then zeros to the pool's size
            word = np.uint64(seeds[r]) if i == 0 else np.uint64(purpose) if i == 1 else np.uint64(0)
            pool[i], hash_const = _hashmix(word, hash_const)
        for i_src in range(4):
            for i_dst in range(4):
                if i_src != i_dst:
                    mixed, hash_const = _hashmix(pool[i_src], hash_const)
                    pool[i_dst] = _mix(pool[i_dst], mixed)
        hash_const = _INIT_B
        words = np.zeros(8, dtype=np.uint64)
        for i in range(8):  # generate_state(4, uint64): 8 words from the pool, cycled
            value = pool[i % 4] ^ hash_const
            hash_const = (hash_const * _MULT_B) & _MASK32
            value = (value * hash_const) & _MASK32
            words[i] = value ^ (value >> np.uint64(16))
        seed_hi, seed_lo = words[0] | (words[1] << np.uint64(32)), words[2] | (words[3] << np.uint64(32))
        seq_hi, seq_lo = words[4] | (words[5] << np.uint64(32)), words[6] | (words[7] << np.uint64(32))
        inc_hi = (seq_hi << np.uint64(1)) | (seq_lo >> np.uint64(63))
        inc_lo = (seq_lo << np.uint64(1)) | np.uint64(1)
        hi, lo = _pcg_step(np.uint64(0), np.uint64(0), inc_hi, inc_lo)  # srandom: step, add the seed, step
        low = lo + seed_lo
        hi, lo = hi + seed_hi + (np.uint64(1) if low < lo else np.uint64(0)), low
        hi, lo = _pcg_step(hi, lo, inc_hi, inc_lo)
        out[r, 0], out[r, 1], out[r, 2], out[r, 3] = hi, lo, inc_hi, inc_lo


def pcg64_state(g: np.random.Generator):
    """g's PCG64 state as `fill_normals_pcg64` takes it, or None (another bit generator, or this numba/NumPy pair
    not drawing NumPy's numbers: `pcg64_matches`)."""
    if type(g.bit_generator) is not np.random.PCG64 or not pcg64_matches():
        return None
    return _state_array(g)


def _state_array(g: np.random.Generator) -> np.ndarray:
    s = g.bit_generator.state["state"]
    return np.array([s["state"] >> 64, s["state"] & _LOW, s["inc"] >> 64, s["inc"] & _LOW], dtype=np.uint64)


@functools.lru_cache(maxsize=1)
def pcg64_matches() -> bool:
    """Whether `fill_normals_pcg64` draws `Generator.standard_normal`'s numbers here, number for number (checked
    once per process on 3 × 40,000 draws: the ziggurat's tail and wedges included)."""
    if not ZIGGURAT_TABLES:
        return False
    for seed in (0, 7, 20240917):
        want = np.random.default_rng([seed, 2]).standard_normal((2, 20_000))
        state = _state_array(np.random.default_rng([seed, 2]))
        got = np.empty((2, 1, 20_000))
        try:
            fill_normals_pcg64(state, got, 0)
        except Exception:  # e.g. a numba that cannot compile the 128-bit intrinsic: the Generator path
            return False
        if not np.array_equal(got[:, 0], want):
            return False
    return True


@functools.lru_cache(maxsize=1)
def seeding_matches() -> bool:
    """Whether `seeded_states` gives `default_rng([seed, purpose])`'s PCG64 state here (checked once per process on
    seeds across the 32-bit range)."""
    seeds = np.array([0, 1, 2, 7, 1000, 20240917, 2**31, 2**32 - 1], dtype=np.int64)
    for purpose in (0, 1, 2):
        got = np.empty((seeds.size, 4), dtype=np.uint64)
        try:
            seeded_states(seeds, purpose, got)
        except Exception:  # a numba that cannot compile it: the generators' states
            return False
        want = [_state_array(np.random.default_rng([int(seed), purpose])) for seed in seeds]
        if not np.array_equal(got, np.array(want)):
            return False
    return True


@functools.lru_cache(maxsize=1)
def exponentials_match() -> bool:
    """Whether `fill_exponentials_pcg64` draws `Generator.standard_exponential`'s numbers here, number for number
    (checked once per process on 3 × 40,000 draws: the ziggurat's tail and wedges included)."""
    if not pcg64_matches():
        return False
    for seed in (0, 7, 20240917):
        want = np.random.default_rng([seed, 1]).standard_exponential(40_000)
        state = _state_array(np.random.default_rng([seed, 1]))
        got = np.empty(40_000)
        try:
            fill_exponentials_pcg64(state, got)
        except Exception:  # a numba that cannot compile it: NumPy's path
            return False
        if not np.array_equal(got, want):
            return False
    return True
