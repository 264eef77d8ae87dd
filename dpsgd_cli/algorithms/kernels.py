"""Numba kernels for the loops over single examples that cannot be vectorised (optional: `pip install 'dpsgd[numba]'`).

Only where one example per step is inherent: `song2013` with b = 1, `bassily2014`, and `pidp_sgd`'s rounds with
one example per step (their noise a `masked_noise` transform, the decisions computed in NumPy before the round).
A step's work is a few d-vectors, dominated by NumPy's per-call overhead; the kernel runs a whole pass (or at most
`CHUNK_ELEMENTS` noise numbers) in one call. On the one-hidden-layer MLP, which only pidp_sgd's chains bring here
(`GradientChain.mlp_kernel`), `sgd1_mlp` runs the same step on the MLP's gradient (models/mlp.py), every parameter
updated in θ's layout order with its noise draw.

Same random numbers on both paths: the sampling indices and the noise are drawn with NumPy from the replica
streams exactly as the NumPy samplers draw them (same generators, same calls, same block sizes: a permutation
per pass, `integers` / noise draws in blocks of `BLOCK_STEPS` steps) and passed into the kernel, or, for standard
normal noise (`bassily2014`), drawn inside the kernel from the same generators (numba's support for
`np.random.Generator` runs NumPy's own ziggurat on the same bit generator: the same numbers, in the same order),
so a seed gives the same run whichever backend trains it (equal up to floating-point summation order;
tests/test_kernels.py asserts rtol 1e-12).

The update of one step, for replica r, example i = idx[t, r] (logistic regression, ℓ = log(1 + e^{−y θ·x})):

    a   = −y σ(−y θ·x)                                   (∇ℓ = a x)
    a  ← a · C / max(|a|‖x‖, C)                           (clip ‖∇ℓ‖ to C; skipped when clip is None)
    g   = ((a x + s·z_t) · batch_scale) + λθ              (z_t the step's noise, s its scale; λθ skipped if λ = 0)
    θ  ← θ − η_t g,   then θ ← θ · min(1, ρ/‖θ‖)          (projection onto the ball of radius ρ, if any)

which is, operation for operation, `GradientChain` with `clipped_grad_sum` → `add_noise(s)` → `scale` → `add_l2`
→ schedule → `project_to_ball` (see the callers in song2013.py and bassily.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from dpsgd_cli import compiled
from dpsgd_cli.algorithms.sampling import IndexedBatches
from dpsgd_cli.algorithms.streams import BLOCK_STEPS
from dpsgd_cli.compiled import Backend
from dpsgd_cli.errors import UserError
from dpsgd_cli.models.logreg import LogisticRegression
from dpsgd_cli.models.mlp import MLP
from dpsgd_cli.models.rows import row_norms

_NO_MASK = np.zeros((1, 1), dtype=np.bool_)
CHUNK_ELEMENTS = 1 << 23  # noise numbers per kernel call (64 MB in float64): a whole pass on adult / kddcup99


def kernel_applies(model, batch_size: int | None, mlp: bool = False) -> bool:
    """The kernels implement one example per step (batch size 1) on a `LogisticRegression`, or, where the caller
    allows it (`mlp`: pidp_sgd), an `MLP`, whose gradient is not overridden (the audit's canary models override
    it: they train on the NumPy chain, vectorised over the audit's many replicas)."""
    if batch_size != 1:
        return False
    if isinstance(model, LogisticRegression):
        return type(model).clipped_grad_sum is LogisticRegression.clipped_grad_sum
    return mlp and isinstance(model, MLP) and type(model).clipped_grad_sum is MLP.clipped_grad_sum


def plain_logreg_float64(model, batches, thetas) -> bool:
    """Whether the compiled logistic-regression steps can take this model and data: a plain `LogisticRegression`
    (its `clipped_grad_sum` not overridden, not the audit's canary models), batches cut by index from float64 X,
    2-D float64 θs."""
    return (isinstance(model, LogisticRegression) and hasattr(model, "d")
            and type(model).clipped_grad_sum is LogisticRegression.clipped_grad_sum
            and isinstance(batches, IndexedBatches) and batches.X.dtype == np.float64
            and all(theta.dtype == np.float64 and theta.ndim == 2 for theta in thetas))


def checkpoint_stops(chains: Sequence, steps: Sequence[int]) -> tuple[list[set], list[int]]:
    """Each chain's steps after which `GradientChain.step` records a checkpoint, and every step at which a compiled
    call must stop (a chain's end or one of those records)."""
    records = [set(c.checkpoints.record_steps(c.examples_per_step, s).tolist()) if c.checkpoints else set()
               for c, s in zip(chains, steps)]
    return records, sorted({*steps, *(t for rec in records for t in rec)})


def record_checkpoints(model, chains: Sequence, running, records: list[set], stop: int,
                       theta_of: Callable[[int], np.ndarray]) -> None:
    """After a compiled call that ended at step `stop`: record each running chain's checkpoint due there, from its
    θ `theta_of(c)`, as `GradientChain.step` records it."""
    for c, chain in enumerate(chains):
        if running[c] and stop in records[c]:
            e = chain.examples_per_step
            with np.errstate(all="ignore"):
                chain.checkpoints.maybe_record(model, theta_of(c), round((stop - 1) * e), round(stop * e))


def select_backend(requested: Backend, model, batch_size: int | None, mlp: bool = False) -> str:
    """'numba' or 'numpy' for this run.

    auto: numba where a kernel applies (b = 1, logreg; or mlp when the caller allows it) and numba is installed,
    else numpy; numba: the kernel where it applies (UserError if numba is missing); numpy: never the kernel.
    """
    if requested == "numpy":
        return "numpy"
    compiled.check_backend(requested)
    if not (compiled.HAVE_NUMBA and kernel_applies(model, batch_size, mlp)):
        return "numpy"
    try:
        _kernels()  # imports numba and compiles (or loads the cached kernel) once per process
    except UserError:
        if requested == "numba":
            raise
        return "numpy"  # auto: numba installed but broken, the NumPy path runs
    return "numba"


# --- random numbers, drawn exactly as the NumPy samplers and `streams.per_step` draw them -----------------------


class _Reader:
    """Take the next m steps from an iterator of (K, ...) blocks (blocks split and joined as needed)."""

    def __init__(self, blocks: Iterator[np.ndarray]):
        self.blocks: Iterator[np.ndarray] = blocks
        self.rest: np.ndarray | None = None

    def take(self, m: int) -> np.ndarray:
        parts, have = [], 0
        while have < m:
            block = self.rest if self.rest is not None else next(self.blocks)
            self.rest = None
            need = m - have
            if len(block) > need:
                block, self.rest = block[:need], block[need:]
            parts.append(block)
            have += len(block)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def schedule_values(schedule: Callable[..., float], start: int, stop: int) -> np.ndarray:
    """η_t for t = start..stop−1: the schedule applied to an array of t when it is elementwise (the chain's
    `constant`, `inverse_sqrt`, `inverse_time`), else called step by step."""
    t = np.arange(start, stop, dtype=np.float64)
    try:
        values = np.asarray(schedule(t), dtype=np.float64)
    except (TypeError, ValueError):
        values = None
    if values is not None and values.ndim == 0:
        return np.full(t.shape, float(values))
    if values is not None and values.shape == t.shape:
        return values
    return np.fromiter((schedule(s) for s in range(start, stop)), dtype=np.float64, count=stop - start)


# --- the kernel ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _kernels():
    """Compile (or load from numba's on-disk cache) the kernels; imports numba."""
    try:
        import numba
    except Exception as exc:  # installed but broken (e.g. a NumPy it does not support)
        raise UserError(f"numba could not be imported ({type(exc).__name__}: {exc}); reinstall it "
                        f"({compiled.NUMBA_HINT}) or use backend: numpy") from exc
    from dpsgd_cli.models._logreg_numba import clip_residual, residual_from_exp

    @numba.njit(cache=True, nogil=True, inline="always")
    def _step_noise(zs, gen, noise, t, r, do_noise, draw_noise):  # pragma: no cover
        """zs ← the step's P standard normals (whenever there is noise, masked or not): drawn from `gen` in
        coordinate order, or noise[t, r]."""
        if do_noise:
            for p in range(zs.shape[0]):
                zs[p] = gen.standard_normal() if draw_noise else noise[t, r, p]

    @numba.njit(cache=True, nogil=True, inline="always")
    def _update(theta_p, g, z, noisy, noise_std, batch_scale, l2, eta):  # pragma: no cover
        """One coordinate of a single-example step (sgd1_logreg, sgd1_mlp): the new θ_p = θ_p − η((g + s z)·scale
        + λθ_p) (z only on noisy steps). Scalars in, scalar out: with θ, the noise and the generator as arguments
        (drawing inside) the coordinate loop runs 3–8× slower."""
        if noisy:
            g = g + noise_std * z
        g = g * batch_scale
        if l2 != 0.0:
            g = g + l2 * theta_p
        return theta_p - eta * g

    @numba.njit(cache=True, nogil=True, inline="always")
    def _project_row(theta, r, sq, radius):  # pragma: no cover
        """θ_r ← θ_r · min(1, ρ/‖θ_r‖) given sq = ‖θ_r‖² (the projection onto the ball of radius ρ)."""
        f = radius / max(np.sqrt(sq), 1e-300)
        if f < 1.0:
            for p in range(theta.shape[1]):
                theta[r, p] = theta[r, p] * f

    @numba.njit(cache=True, nogil=True)
    def sgd1_logreg(theta, X, y, x_norm, idx, noise, gen, noise_std, lrs, l2, clip, radius, batch_scale,
                    start, stop, do_clip, do_noise, draw_noise, do_project, mask, use_mask):  # pragma: no cover
        R, d = theta.shape
        zs = np.empty(d)  # the step's standard normals
        for r in range(R):
            for t in range(start, stop):
                i = idx[t, r]
                dot = 0.0
                for j in range(d):
                    dot += X[i, j] * theta[r, j]
                yi = y[i]
                a = residual_from_exp(yi, np.exp(yi * dot))
                if do_clip:
                    a = clip_residual(a, x_norm[i], clip)
                eta = lrs[t]
                noisy = do_noise and (not use_mask or mask[t, r])  # pidp_sgd: the step's noise decision
                _step_noise(zs, gen, noise, t, r, do_noise, draw_noise)
                sq = 0.0
                for j in range(d):
                    v = _update(theta[r, j], a * X[i, j], zs[j], noisy, noise_std, batch_scale, l2, eta)
                    theta[r, j] = v
                    sq += v * v
                if do_project:
                    _project_row(theta, r, sq, radius)
        return theta

    @numba.njit(cache=True, nogil=True)
    def sgd1_mlp(theta, X, y, x_norm, idx, noise, gen, noise_std, lrs, l2, clip, radius, batch_scale,
                 start, stop, do_clip, do_noise, draw_noise, do_project, mask, use_mask, h, act):  # pragma: no cover
        # θ = [W₁ (h×d, row-major) | b₁ (h) | w₂ (h) | b₂] (models/mlp.py); act: 0 tanh, 1 sigmoid, 2 relu
        R, P = theta.shape
        d = X.shape[1]
        o_b1, o_w2, o_b2 = h * d, h * d + h, h * d + 2 * h
        a = np.empty(h)
        delta = np.empty(h)
        zs = np.empty(P)  # the step's standard normals
        grad = np.empty(P)
        for r in range(R):
            for t in range(start, stop):
                i = idx[t, r]
                f = theta[r, o_b2]
                sq_a = 0.0
                sq_u = 0.0
                for k in range(h):  # forward: z = W₁x + b₁, a = φ(z); u = w₂ ⊙ φ'(z) kept in `delta`
                    z = theta[r, o_b1 + k]
                    for j in range(d):
                        z += theta[r, k * d + j] * X[i, j]
                    if act == 0:
                        ak = np.tanh(z)
                        dk = 1.0 - ak * ak
                    elif act == 1:
                        ak = 1.0 / (1.0 + np.exp(-z))
                        dk = (1.0 - ak) * ak
                    else:
                        ak = z if z > 0.0 else 0.0
                        dk = 1.0 if z > 0.0 else 0.0
                    a[k] = ak
                    f += theta[r, o_w2 + k] * ak
                    u = dk * theta[r, o_w2 + k]
                    delta[k] = u
                    sq_a += ak * ak
                    sq_u += u * u
                yi = y[i]
                res = residual_from_exp(yi, np.exp(yi * f))  # ∂ℓ/∂f
                if do_clip:  # ‖∇ℓ‖ = |res| √(1 + ‖a‖² + ‖u‖²(‖x‖² + 1)) (models/mlp.py)
                    norm = abs(res) * np.sqrt(1.0 + sq_a + sq_u * (x_norm[i] * x_norm[i] + 1.0))
                    res = res * (clip / max(norm, clip))
                for k in range(h):
                    delta[k] = delta[k] * res
                eta = lrs[t]
                noisy = do_noise and (not use_mask or mask[t, r])
                _step_noise(zs, gen, noise, t, r, do_noise, draw_noise)  # P standard normals, in layout order
                for k in range(h):  # the gradient, from the θ of before the step, in θ's layout order
                    for j in range(d):
                        grad[k * d + j] = delta[k] * X[i, j]
                    grad[o_b1 + k] = delta[k]
                    grad[o_w2 + k] = res * a[k]
                grad[o_b2] = res
                sq = 0.0
                for p in range(P):
                    v = _update(theta[r, p], grad[p], zs[p], noisy, noise_std, batch_scale, l2, eta)
                    theta[r, p] = v
                    sq += v * v
                if do_project:
                    _project_row(theta, r, sq, radius)
        return theta

    return {"sgd1_logreg": sgd1_logreg, "sgd1_mlp": sgd1_mlp, "version": numba.__version__}


def warm_up() -> float:
    """Compile or load the kernels now; returns the seconds it took (the benchmark reports it)."""
    start = time.perf_counter()
    kernel = _kernels()["sgd1_logreg"]
    X, y = np.ones((1, 1)), np.ones(1)
    for draw in (False, True):
        kernel(np.zeros((1, 1)), X, y, np.ones(1), np.zeros((1, 1), dtype=np.int64), np.zeros((1, 1, 1)),
               np.random.default_rng(0), 0.0, np.ones(1), 0.0, 1.0, 1.0, 1.0, 0, 1, True, True, draw, True,
               _NO_MASK, False)
    return time.perf_counter() - start


def single_example_sgd(theta: np.ndarray, X: np.ndarray, y: np.ndarray, indices: Callable[[int], np.ndarray],
                       steps: int, schedule: Callable[[int], float], *, clip: float | None, l2: float,
                       radius: float | None, noise: Iterator[np.ndarray] | None = None,
                       noise_std: float = 0.0, batch_scale: float = 1.0, checkpoints=None,
                       model=None, noise_generators: list[np.random.Generator] | None = None,
                       noise_mask: np.ndarray | None = None, x_norm: np.ndarray | None = None) -> np.ndarray:
    """`steps` single-example steps of projected (noisy, clipped) SGD for every replica, by the numba kernel
    (module docstring): logistic regression (θ (R, d)), or the one-hidden-layer `MLP` when `model` is one
    (θ (R, P), `sgd1_mlp`: the same step on the MLP's gradient, models/mlp.py). θ is not modified; the result is
    returned.

    indices: `indices(m)` the next m steps' example indices (m, R); noise: (K, R, d) blocks of the noise's
    standard draws (None: no noise); noise_generators: instead of `noise`, one generator per replica whose standard
    normals (d per step, in order) the kernel draws itself: the numbers `streams.blocks(purpose, lambda g, k:
    g.standard_normal((k, d)))` yields (numba's Generator support runs NumPy's ziggurat on the same bit
    generator), never materialised; noise_mask: (steps, R)
    bool, noise only on the True steps (pidp_sgd; the draws are consumed on every step either way);
    checkpoints: a `chain.Checkpoints` (one example per step, counted from its `offset`), recorded as
    `GradientChain.run` does; x_norm: ‖x_i‖ of every row (`rows.row_norms(X)`) when the caller has it already.
    """
    if noise is not None and noise_generators is not None:
        raise ValueError("give noise blocks or noise generators, not both")
    kernel, extra = _kernel_for(model)
    theta = np.array(theta, copy=True, order="C")
    X = np.ascontiguousarray(X)
    y = np.ascontiguousarray(y)
    x_norm = row_norms(X) if x_norm is None else np.ascontiguousarray(x_norm)
    R, d = theta.shape
    chunk = max(BLOCK_STEPS, (CHUNK_ELEMENTS // max(1, R * d)) // BLOCK_STEPS * BLOCK_STEPS)
    noise_reader = _Reader(noise) if noise is not None else None
    no_noise = np.zeros((1, 1, 1), dtype=np.float64)
    no_gen = np.random.default_rng(0)  # a placeholder of the kernel's signature, never drawn from
    if noise_generators is not None and len(noise_generators) != R:
        raise ValueError(f"{len(noise_generators)} noise generators for {R} replicas")
    every = checkpoints.every if checkpoints is not None else None
    offset = checkpoints.offset if checkpoints is not None else 0
    done = 0
    while done < steps:
        m = min(chunk, steps - done)
        idx = np.ascontiguousarray(indices(m), dtype=np.int64)
        z = np.ascontiguousarray(noise_reader.take(m)) if noise_reader is not None else no_noise
        lrs = schedule_values(schedule, done + 1, done + m + 1)
        mask = (np.ascontiguousarray(noise_mask[done:done + m], dtype=np.bool_) if noise_mask is not None
                else _NO_MASK)
        idx_r = [np.ascontiguousarray(idx[:, r:r + 1]) for r in range(R)]  # per replica, for the drawing calls
        cuts = [m]
        if every:  # stop after each step t (1-based) with (offset + t) % every == 0, to record a checkpoint
            first = ((offset + done) // every + 1) * every - offset
            cuts = sorted({*range(first - done, m + 1, every), m}) if first - done <= m else [m]
        lo = 0
        for hi in cuts:
            scalars = (float(noise_std), lrs, float(l2 or 0.0), float(clip) if clip is not None else 1.0,
                       float(radius) if radius is not None else 1.0, float(batch_scale), lo, hi, clip is not None)
            masked = noise_mask is not None

            if noise_generators is not None:  # one call per replica: each draws from its own generator, in order
                for r, gen in enumerate(noise_generators):
                    mask_r = np.ascontiguousarray(mask[:, r:r + 1]) if masked else _NO_MASK
                    kernel(theta[r:r + 1], X, y, x_norm, idx_r[r], no_noise, gen, *scalars, True,
                           True, radius is not None, mask_r, masked, *extra)
            else:
                kernel(theta, X, y, x_norm, idx, z, no_gen, *scalars, noise_reader is not None, False,
                       radius is not None, mask, masked, *extra)
            if checkpoints is not None and hi > lo:
                checkpoints.maybe_record(model, theta, done + hi - 1, done + hi)
            lo = hi
        done += m
    return theta


def single_example_applies(model, chain, theta: np.ndarray) -> bool:
    """Whether a chain runs on the single-example kernel: one example per step cut by index from float64 X (an
    `IndexedBatches` of width 1), transforms [noise or masked_noise] [scale] [l2] in that order with the noise's
    draws described (`chain.noise_source`), a ball or no projection, a plain `LogisticRegression` (or `MLP` where
    the chain allows it, `chain.mlp_kernel`), backend auto or numba."""
    batches = chain.batches
    if (chain.backend == "numpy" or chain.examples_per_step != 1 or not isinstance(batches, IndexedBatches)
            or batches.full or batches.X.dtype != np.float64 or theta.dtype != np.float64):
        return False
    ops = chain.ops()
    kinds = [op[0] for op in ops] if ops is not None else ["opaque"]
    noise = [k for k in kinds if k in ("noise", "masked_noise")]
    if kinds != [*noise[:1], *(k for k in ("scale", "l2") if k in kinds)] or (noise and chain.noise_source is None):
        return False
    try:
        chain.ball_radius()
    except ValueError:
        return False
    return select_backend(chain.backend, model, 1, mlp=chain.mlp_kernel) == "numba"


def run_single_example(model, chain, theta: np.ndarray, steps: int) -> np.ndarray:
    """`steps` steps of a chain that `single_example_applies` to, in the kernel: the same indices (the chain's
    batches, `take`n) and the same noise numbers (drawn from `chain.noise_source` as the transform draws them), on
    the steps its noise mask (masked_noise) says."""
    ops = {op[0]: op[1:] for op in chain.ops()}
    noise_op = ops.get("noise", ops.get("masked_noise"))
    batches, source = chain.batches, chain.noise_source
    noise, generators = None, None
    if noise_op is not None and source.draw is not None:
        noise = source.streams.blocks(source.purpose, source.draw)
    elif noise_op is not None:  # standard normals: drawn inside the kernel from the same generators, in the same order
        generators = source.generators()
    return single_example_sgd(theta, batches.X, batches.y, lambda m: batches.take(m)[:, :, 0], steps, chain.schedule,
                              clip=chain.clip, l2=float(ops["l2"][0] or 0.0) if "l2" in ops else 0.0,
                              radius=chain.ball_radius(), noise=noise,
                              noise_std=float(noise_op[0]) if noise_op is not None else 0.0,
                              batch_scale=float(ops["scale"][0]) if "scale" in ops else 1.0,
                              checkpoints=chain.checkpoints, model=model, noise_generators=generators,
                              noise_mask=ops["masked_noise"][2] if "masked_noise" in ops else None,
                              x_norm=batches.x_norm)


MLP_ACTIVATIONS = {"tanh": 0, "sigmoid": 1, "relu": 2}  # sgd1_mlp's `act`


def _kernel_for(model) -> tuple[Callable, tuple]:
    """(kernel, its trailing arguments) for the model: sgd1_mlp (h, activation code) for an `MLP`, else
    sgd1_logreg."""
    if isinstance(model, MLP):
        return _kernels()["sgd1_mlp"], (model.hidden, MLP_ACTIVATIONS[model.activation])
    return _kernels()["sgd1_logreg"], ()
