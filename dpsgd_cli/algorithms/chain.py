"""Iterative training as a chain of small gradient transformations (in the spirit of optax).

One step: sample a batch per replica → sum of (clipped) per-example gradients → transforms (add noise,
scale, add the regulariser's gradient, ...) → θ ← θ − η_t g → optional projection. Private algorithms of
the papers differ only in their sampler, clip and transforms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import kernels, kernels_fullbatch, kernels_minibatch
from dpsgd_cli.algorithms.sampling import IndexedBatches
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import Batch, Model

_NO_NOISE = np.zeros((0, 0))  # the compiled update's z when the chain adds none (never read)
Schedule = Callable[[int], float]  # step t = 1, 2, ... → learning rate


@dataclass(frozen=True, eq=False)
class Transform:
    """One gradient transformation g ← fn(g, θ) on (R, P) arrays. `kind` and `params` say what it computes
    ("noise" (std, draws), "masked_noise" (std, draws, noisy), "scale" (factor,), "l2" (λ,), "smooth" (σ_ls,),
    "identity" ()), so that a compiled
    backend can run a chain made of known kinds; `fn` is the NumPy definition every backend reproduces."""

    kind: str
    params: tuple
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray]

    def __call__(self, g: np.ndarray, theta: np.ndarray) -> np.ndarray:
        return self.fn(g, theta)


@dataclass(frozen=True, eq=False)
class Projection:
    """θ ← fn(θ) after each update: "ball" (radius,) or "box" (radius,)."""

    kind: str
    radius: float
    fn: Callable[[np.ndarray], np.ndarray]

    def __call__(self, theta: np.ndarray) -> np.ndarray:
        return self.fn(theta)


def add_noise(std: float, draws: Iterator[np.ndarray]) -> Transform:
    """g + std · z with z from `draws` (one (R, P) standard-normal array per step; float64 draws, so a seed
    gives the same noise whatever the training precision, cast to the gradient's dtype)."""
    return Transform("noise", (std, draws), lambda g, theta: g + (std * next(draws)).astype(g.dtype, copy=False))


def masked_noise(std: float, draws: Iterator[np.ndarray], noisy: np.ndarray) -> Transform:
    """g + std · z on the replicas whose step is noisy: step t adds the noise where noisy[t] (T, R) is True. z is
    drawn at every step, noisy or not, so the noise stream does not depend on the decisions (pidp_sgd)."""
    rows = iter(noisy)
    return Transform("masked_noise", (std, draws, noisy),
                     lambda g, theta: g + np.where(next(rows), std, 0.0)[:, None] * next(draws))


def scale(factor: float) -> Transform:
    return Transform("scale", (factor,), lambda g, theta: g * factor)


def add_l2(l2: float) -> Transform:
    """Add the regulariser's gradient λθ (data-independent: no privacy cost)."""
    return Transform("l2", (l2,), lambda g, theta: g + l2 * theta if l2 else g)


def constant(lr: float) -> Schedule:
    return lambda t: lr


def inverse_sqrt(c: float) -> Schedule:
    """η_t = c/√t (Song et al. 2013 use c = 1 and 10; Bassily et al. 2014: R/(l√t))."""
    return lambda t: c / t**0.5


def inverse_time(c: float) -> Schedule:
    """η_t = c/t (for an s-strongly convex objective c = 1/s: Bassily et al. 2014; Song et al. 2013 1/(λt))."""
    return lambda t: c / t


def min_inverse_time(beta: float, gamma: float) -> Schedule:
    """η_t = min(1/β, 1/(γt)) (Wu et al. 2017, strongly convex case)."""
    return lambda t: min(1.0 / beta, 1.0 / (gamma * t))


def project_to_ball(radius: float) -> Projection:
    """Euclidean projection of each replica's θ onto {‖θ‖ ≤ radius}."""

    def project(theta: np.ndarray) -> np.ndarray:
        norm = np.linalg.norm(theta, axis=1, keepdims=True)
        return theta * np.minimum(1.0, radius / np.maximum(norm, 1e-300))

    return Projection("ball", radius, project)


def project_to_box(radius: float) -> Projection:
    """Projection of each replica's θ onto the box [−radius, radius]^P (coordinate-wise clipping)."""
    return Projection("box", radius, lambda theta: np.clip(theta, -radius, radius))


def laplacian_eigenvalues(sigma_ls: float, P: int) -> np.ndarray:
    """Eigenvalues 1 + 2σ_ls(1 − cos(2πk/P)), k = 0..P−1, of A = I − σ_ls Δ, Δ the periodic 1-D Laplacian on R^P.

    Δv_i = v_{i−1} − 2v_i + v_{i+1} (indices mod P) is circulant, so the DFT diagonalises it. P = 1: Δ = 0
    (both neighbours are the entry itself); P = 2: Δ = [[−2, 2], [2, −2]] (both neighbours are the other entry).
    """
    k = np.arange(P)
    return 1.0 + 2.0 * sigma_ls * (1.0 - np.cos(2.0 * np.pi * k / P))


def laplacian_smoothing(sigma_ls: float, P: int | None = None) -> Transform:
    """g ← (I − σ_ls Δ)⁻¹ g for each replica's gradient (R, P), by FFT (O(P log P)).

    Δ is the 1-D discrete Laplacian with periodic boundary on the flat parameter vector (Wang et al., DP-LSSGD;
    Osher et al., Laplacian smoothing gradient descent). σ_ls = 0 is the identity (returns g itself). With P
    None the length is taken from the gradient at the first call (a chain is built before the model is known).
    Data-independent post-processing: no privacy cost.
    """
    sigma_ls = float(sigma_ls)
    if not (np.isfinite(sigma_ls) and sigma_ls >= 0):
        raise UserError(f"smoothing must be a finite number ≥ 0, got {sigma_ls!r}")
    if sigma_ls == 0:
        return Transform("identity", (), lambda g, theta: g)
    cache: dict[int, np.ndarray] = {}
    if P is not None:
        cache[int(P)] = 1.0 / laplacian_eigenvalues(sigma_ls, int(P))[: int(P) // 2 + 1]

    def smooth(g: np.ndarray, theta: np.ndarray) -> np.ndarray:
        p = g.shape[-1]
        if P is not None and p != P:
            raise ValueError(f"laplacian_smoothing built for P = {P}, got a gradient of length {p}")
        inverse = cache.get(p)
        if inverse is None:
            inverse = cache[p] = 1.0 / laplacian_eigenvalues(sigma_ls, p)[: p // 2 + 1]
        return np.fft.irfft(np.fft.rfft(g, axis=-1) * inverse, n=p, axis=-1)

    return Transform("smooth", (sigma_ls,), smooth)


def smoothed_noise_variance_factor(sigma_ls: float, P: int) -> float:
    """Per-coordinate variance of (I − σ_ls Δ)⁻¹ z over that of z ~ N(0, I): (1/P) Σ_k (1 + 2σ_ls(1 − cos 2πk/P))⁻²."""
    return float(np.mean(laplacian_eigenvalues(sigma_ls, P) ** -2.0))


# --- the algorithm -------------------------------------------------------------------------------------------------


@dataclass
class Checkpoints:
    """Records the training objective every `every` examples processed (for the per-iteration figures)."""

    every: int
    X: np.ndarray
    y: np.ndarray
    rows: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)
    offset: int = 0  # examples processed before the chain's first step (a run of several chains: pidp_sgd's rounds)

    def shifted(self, offset: int) -> Checkpoints:
        """These checkpoints (the same rows) for a chain that starts after `offset` examples."""
        return replace(self, offset=offset)

    def record_steps(self, examples_per_step: float, steps: int) -> np.ndarray:
        """The steps t (1-based) after which `GradientChain.step` records a checkpoint (for compiled steps)."""
        t = np.arange(1, steps + 1)
        before = np.array([self.offset + round((s - 1) * examples_per_step) for s in t.tolist()])
        after = np.array([self.offset + round(s * examples_per_step) for s in t.tolist()])
        return t[after // self.every > before // self.every]

    def maybe_record(self, model: Model, theta: np.ndarray, before: int, after: int) -> None:
        """Record after the step that took the chain from `before` to `after` examples, if it crossed a multiple of
        `every` (counted from the run's start)."""
        before, after = before + self.offset, after + self.offset
        if after // self.every > before // self.every:
            with np.errstate(all="ignore"):  # one forward pass: the numbers of `objective` and `accuracy`
                loss, accuracy = model.data_loss_and_accuracy(theta, self.X, self.y)
                self.rows.append((after, loss + model.penalty(theta), accuracy))


@dataclass(frozen=True)
class NoiseSource:
    """The noise's standard draws as the replica streams make them: `streams.per_step(purpose, draw)` (draw given)
    or `streams.normal(purpose, shape)` (draw None)."""

    streams: ReplicaStreams
    purpose: str
    shape: tuple[int, ...] = ()
    draw: Callable[[np.random.Generator, int], np.ndarray] | None = None
    _generators: list[np.random.Generator] = field(default_factory=list, init=False, repr=False, compare=False)

    def generators(self) -> list[np.random.Generator]:
        """The replicas' generators of `purpose`, made at the first call: chains that share this source (pidp_sgd's
        rounds) continue one stream of standard normals, as they share one `streams.normal` iterator on NumPy."""
        if not self._generators:
            self._generators.extend(self.streams.generators(self.purpose))
        return self._generators


@dataclass
class GradientChain:
    batches: Iterator[Batch]
    clip: float | None
    transforms: Sequence[Callable[[np.ndarray, np.ndarray], np.ndarray]] = field(default_factory=list)
    schedule: Schedule = constant(0.1)
    project: Callable[[np.ndarray], np.ndarray] | None = None
    checkpoints: Checkpoints | None = None
    examples_per_step: float = 1.0  # (expected) batch size, to count examples processed for checkpoints
    # What the batches depend on besides the data and the seeds (e.g. ("poisson", q)); chains with equal keys on
    # the same data and seeds draw identical batches, so `run_together` gathers them once. None: never shared.
    stream: Hashable | None = None
    # "auto"/"numba": run on the compiled mini-batch step where it applies (kernels_minibatch.applies: logistic
    # regression, known transforms, an indexed sampler), else on the compiled full-batch step where that applies
    # (kernels_fullbatch.applies: the full batch, transforms in any order); "numpy": never. How, not what: same
    # numbers up to summation order. `ran_on` says which ran ("numpy", "numba", or "numba-rows": NumPy steps whose
    # model read the batch rows in compiled kernels, the MLP's row-sparse step), once the chain has run.
    backend: str = "numpy"
    ran_on: str | None = None
    # What the iterates depend on besides the stream, θ_0 and t (clip, transforms, schedule), for chains whose
    # transforms draw nothing: chains with equal keys, stream keys and θ_0 compute the same iterates, so
    # `run_together` runs only the longest and hands the others its θ at their last step. None: never shared.
    same_iterates: Hashable | None = None
    # How the noise transform's numbers are drawn, for a compiled step that draws the same numbers itself:
    # `NoiseSource` (the single-example kernel); None: only from the transform's iterator.
    noise_source: NoiseSource | None = None
    # Whether an `MLP` may run on the single-example kernel (`sgd1_mlp`), besides logistic regression: pidp_sgd's
    # chains; the other single-example chains keep their MLP runs on NumPy, where their numbers were made.
    mlp_kernel: bool = False

    def ops(self) -> list[tuple] | None:
        """The transforms as (kind, *params) in order, identities dropped; None when one is not a `Transform` (a
        function only NumPy runs). What every compiled backend reads of a chain."""
        ops = []
        for transform in self.transforms:
            if not isinstance(transform, Transform):
                return None
            if transform.kind != "identity":
                ops.append((transform.kind, *transform.params))
        return ops

    def ball_radius(self) -> float | None:
        """The radius of the projection onto a ball; None without a projection. ValueError for another one."""
        if self.project is None:
            return None
        if isinstance(self.project, Projection) and self.project.kind == "ball":
            return float(self.project.radius)
        raise ValueError("not a projection onto a ball")

    def step(self, model: Model, theta: np.ndarray, t: int, batch: Batch) -> np.ndarray:
        """Update t (1, 2, ...) of θ (R, P), in place where possible, on `batch`; returns the new θ."""
        if hasattr(batch, "plain") and not self._compiled_rows():  # the model may not take the compiled rows path
            batch = batch.plain()
        elif t == 1 and model.reads_rows_compiled(batch, theta):  # the path is the data's: the same at every step
            self.ran_on = "numba-rows"
        g = model.clipped_grad_sum(theta, batch, self.clip)
        lr = self.schedule(t)
        fused = self._fused_update(theta, g, lr)
        if fused is not None:  # the same numbers in one compiled pass (`_update_numba`)
            kernel, noise, factor, l2 = fused
            dtype = theta.dtype.type
            z = next(noise[1]) if noise is not None else _NO_NOISE
            kernel(theta, g, z, 0.0 if noise is None else noise[0], dtype(factor), dtype(l2), dtype(lr),
                   noise is not None, bool(l2), np.empty(theta.shape[1], theta.dtype))
        else:
            for transform in self.transforms:
                g = transform(g, theta)
            theta -= lr * g
        if self.project is not None:
            theta = self.project(theta)
        if self.checkpoints is not None:
            before, after = round((t - 1) * self.examples_per_step), round(t * self.examples_per_step)
            self.checkpoints.maybe_record(model, theta, before, after)
        return theta

    def _fused_update(self, theta: np.ndarray, g: np.ndarray, lr):
        """(kernel, noise (std, draws) or None, factor, λ) when the transforms are `sgd`'s and `dp_sgd`'s
        ([add_noise,] scale, add_l2) and the compiled update may run (backend auto or numba, numba installed; θ and
        g C-contiguous (R, P) arrays of one float dtype; std, factor, λ and η Python numbers, which NumPy rounds to
        the array's dtype, unlike NumPy scalars), else None."""
        if not self._compiled_rows():  # first: a NumPy chain's step reads no more of it
            return None
        kinds = self.ops() or []
        if [k[0] for k in kinds] not in (["noise", "scale", "l2"], ["scale", "l2"]):
            return None
        if not all(type(x) in (float, int) for x in (lr, kinds[-2][1], kinds[-1][1], *kinds[0][1:2])):
            return None
        if not (theta.dtype == g.dtype and theta.dtype in (np.float32, np.float64) and theta.ndim == 2
                and theta.shape == g.shape and theta.flags.c_contiguous and g.flags.c_contiguous):
            return None
        module = compiled.optional_compiled("algorithms._update_numba")
        if module is None:
            return None
        noise = (kinds[0][1], kinds[0][2]) if kinds[0][0] == "noise" else None
        return module.noisy_update, noise, kinds[-2][1], kinds[-1][1]

    def _compiled_rows(self) -> bool:
        """Whether the model may read a batch's rows in a compiled product (the MLP's row-sparse kernels, models/
        _mlp_numba.py): backend auto or numba, and numba installed (looked up here: tests switch it off)."""
        if self.backend == "numpy":
            return False
        compiled.check_backend(self.backend)
        return compiled.HAVE_NUMBA

    def run(self, model: Model, theta: np.ndarray, steps: int) -> np.ndarray:
        """Apply `steps` updates to θ (R, P); a replica that diverges ends as NaN without stopping the others."""
        if self.backend != "numpy":
            return run_together(model, [self], [theta], [steps])[0]
        self.ran_on = "numpy"
        theta = theta.copy()
        with np.errstate(over="ignore", invalid="ignore"):
            for t in range(1, steps + 1):
                theta = self.step(model, theta, t, next(self.batches))
        return theta


def run_together(model: Model, chains: Sequence[GradientChain], thetas: Sequence[np.ndarray],
                 steps: Sequence[int]) -> list[np.ndarray]:
    """Run several chains (same model, data and seeds) in lockstep; each chain's result equals `chain.run`.

    Chains with the same `stream` key share one batch per step: the first such chain's iterator is drawn,
    the others' are never started. Each chain keeps its own θ, transforms (noise, σ), schedule and clip, and
    computes exactly what it would alone (same arrays, same calls), so fused runs are bit for bit the same.

    Chains with a compiled step (`backend`, kernels_minibatch.applies; they take it alone too) run in the numba
    kernel instead, those of a stream together (the batch read once per step for all of them; each chain's sums
    in an order that does not depend on the others, so fused is still bit for bit alone); NumPy chains of the
    same stream replay the batches the kernel takes (`IndexedBatches.replay`). Full-batch chains that kernel does
    not take (e.g. `noisy_gd`'s order scale → λθ → noise) run on the compiled full-batch step where it applies
    (kernels_fullbatch), all in one call (X read once a step for all of them; again each chain's sums in an order
    independent of the others).
    """
    keys = [chain.stream if chain.stream is not None else ("own", k) for k, chain in enumerate(chains)]
    thetas = [theta.copy() for theta in thetas]
    numpy_side, sources, runs = list(range(len(chains))), {}, []
    if any(chain.backend != "numpy" for chain in chains):  # single-example chains: each alone on its kernel
        for k in [k for k in numpy_side if kernels.single_example_applies(model, chains[k], thetas[k])]:
            thetas[k], chains[k].ran_on = kernels.run_single_example(model, chains[k], thetas[k], steps[k]), "numba"
            numpy_side.remove(k)
    if any(chains[k].backend != "numpy" for k in numpy_side):
        # each chain on the path it takes alone (so fused is alone, bit for bit): the compiled ones of a stream
        # together, the others on NumPy, replaying the batches the kernel takes
        compiled = [k for k in numpy_side if kernels_minibatch.applies(model, [chains[k]], [thetas[k]])]
        numpy_side = [k for k in numpy_side if k not in compiled]
        for key in dict.fromkeys(keys[k] for k in compiled):
            group = [k for k in compiled if keys[k] == key]
            out: list = []
            run = kernels_minibatch.group_steps(model, [chains[k] for k in group], [thetas[k] for k in group],
                                                [steps[k] for k in group], out)
            runs.append((group, run, out))
            taken = chains[group[0]].batches
            if any(keys[k] == key for k in numpy_side) and isinstance(taken, IndexedBatches):  # applies needs them
                sources[key] = taken.replay(functools.partial(_advance, run))
    if any(chains[k].backend != "numpy" for k in numpy_side):  # full-batch chains: the compiled full-batch step
        full = [k for k in numpy_side if kernels_fullbatch.applies(model, chains[k], thetas[k])]
        numpy_side = [k for k in numpy_side if k not in full]
        if full:
            for k, theta in zip(full, kernels_fullbatch.run(model, [chains[k] for k in full],
                                                            [thetas[k] for k in full], [steps[k] for k in full])):
                thetas[k], chains[k].ran_on = theta, "numba"
    shared: dict = dict(sources)
    for k in numpy_side:
        chains[k].ran_on = "numpy"
        shared.setdefault(keys[k], chains[k].batches)
    last = {key: max(steps[k] for k in numpy_side if keys[k] == key) for key in shared}
    lead = _leaders(chains, keys, thetas, steps, numpy_side)
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(1, max((steps[k] for k in numpy_side), default=0) + 1):
            batch = {key: next(it) for key, it in shared.items() if t <= last[key]}
            for k in numpy_side:
                if t <= steps[k] and lead[k] == k:
                    thetas[k] = chains[k].step(model, thetas[k], t, batch[keys[k]])
            for k in numpy_side:
                if t == steps[k] and lead[k] != k:
                    thetas[k] = thetas[lead[k]].copy()
    for k in numpy_side:  # a chain that took its leader's iterates took its path too
        chains[k].ran_on = chains[lead[k]].ran_on
    for group, run, out in runs:
        taps = getattr(chains[group[0]].batches, "taps", None)
        if taps:  # the NumPy chains are done: stop keeping the kernel's indices for them
            taps.clear()
        for _ in run:  # the rest of the compiled steps
            pass
        for k, theta in zip(group, out):
            thetas[k], chains[k].ran_on = theta, "numba"
    return thetas


def _advance(run: Iterator) -> bool:
    """Let a compiled run take its next steps; False once it has finished."""
    return next(run, None) is not None


def _leaders(chains: Sequence[GradientChain], keys: list, thetas: list[np.ndarray], steps: Sequence[int],
             ks: Sequence[int]) -> dict[int, int]:
    """k → the chain that computes chain k's iterates (k itself, or the longest chain with the same
    `same_iterates` and stream keys and the same θ_0; chains with checkpoints always run themselves)."""
    groups: list[list[int]] = []
    for k in ks:
        chain = chains[k]
        if chain.same_iterates is None or chain.stream is None or chain.checkpoints is not None:
            continue
        for group in groups:
            j = group[0]
            if ((chains[j].same_iterates, keys[j]) == (chain.same_iterates, keys[k])
                    and thetas[j].dtype == thetas[k].dtype and np.array_equal(thetas[j], thetas[k])):
                group.append(k)
                break
        else:
            groups.append([k])
    lead = {k: k for k in ks}
    for group in groups:
        longest = max(group, key=lambda k: steps[k])
        lead.update(dict.fromkeys(group, longest))
    return lead


def train_together(model: Model, prepared: Sequence) -> list:
    """Train `Algorithm.prepare` results (same model, data and seeds; streams from one `SharedStreams`, closed)
    in lockstep: their Outcomes, each equal to `fit` alone, bit for bit. E.g. an ε axis of `dp_sgd`:

        streams = SharedStreams(seeds)
        prepared = [DPSGD().prepare(setting_for(eps), model, X, y, streams) for eps in epsilons]
        streams.close()
        outcomes = train_together(model, prepared)
    """
    thetas = run_together(model, [p.chain for p in prepared], [p.theta for p in prepared], [p.steps for p in prepared])
    return [p.finish(theta) for p, theta in zip(prepared, thetas)]
