"""Iterative training as a chain of typed ops (ops.py), run by the backend its plan chooses (backends.py).

One step: sample a batch per replica → sum of (clipped) per-example gradients → the ops (noise, scale, weight decay,
smoothing, ...) → the update θ ← θ − η_t g → optional projection. Private algorithms of the papers differ only in
their sampler and their ops.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from dpsgd_cli.algorithms import backends
from dpsgd_cli.algorithms.ops import Clip, Op, OpStates, Projection, Schedule, Sgd, Update
from dpsgd_cli.algorithms.sampling import IndexedBatches
from dpsgd_cli.compiled import Backend
from dpsgd_cli.models import Batch, Model

if TYPE_CHECKING:
    from dpsgd_cli.algorithms.base import Outcome, Prepared


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


@dataclass
class GradientChain:
    batches: Iterator[Batch]
    ops: Sequence[Op]
    checkpoints: Checkpoints | None = None
    examples_per_step: float = 1.0  # (expected) batch size, to count examples processed for checkpoints
    # What the batches depend on besides the data and the seeds (e.g. ("poisson", q)); chains with equal keys on
    # the same data and seeds draw identical batches, so `run_together` gathers them once. None: never shared.
    stream: Hashable | None = None
    # The user's choice (auto, numpy, numba): `backends.choose` decides from it and the chain's plan. How, not what:
    # the same numbers up to summation order. `ran_on` says which ran ("numpy", "numba", or "numba-rows": NumPy
    # steps whose model read the batch rows in compiled kernels, the MLP's row-sparse step), once the chain has run.
    backend: Backend = "auto"
    ran_on: str | None = None
    # What the iterates depend on besides the stream, θ_0 and t (the ops), for chains whose ops draw nothing:
    # chains with equal keys, stream keys and θ_0 compute the same iterates, so `run_together` runs only the
    # longest and hands the others its θ at their last step. None: never shared.
    same_iterates: Hashable | None = None
    _states: OpStates = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ops = tuple(self.ops)
        updates = [k for k, op in enumerate(self.ops) if isinstance(op, Update)]
        if len(updates) != 1 or not all(isinstance(op, Projection) for op in self.ops[updates[0] + 1:]):
            raise ValueError("a chain has one Update op, followed by its projections only")
        self._states = OpStates(self.ops)

    @property
    def clip(self) -> float | None:
        """The clip norm of the chain's `Clip` op (None: no clip)."""
        return next((float(op.norm) for op in self.ops if isinstance(op, Clip)), None)

    def clip_norms(self, theta: np.ndarray) -> np.ndarray | None:
        """The `Clip` op's per-replica norms as they stand (an `AdaptiveClip`'s after the chain's steps; θ (R, P)
        gives their shape before any)."""
        return self._states.clip_norms(theta)

    def set_clip_norms(self, norms: np.ndarray, theta: np.ndarray) -> None:
        """Record the `Clip` op's per-replica norms after a compiled backend's steps (θ (R, P): the ops' states)."""
        self._states.set_clip_norms(norms, theta)

    @property
    def schedule(self) -> Schedule:
        return next(op.schedule for op in self.ops if isinstance(op, Sgd))

    def step(self, model: Model, theta: np.ndarray, t: int, batch: Batch) -> np.ndarray:
        """Update t (1, 2, ...) of θ (R, P), in place where possible, on `batch`, by the ops' NumPy definitions;
        returns the new θ."""
        if hasattr(batch, "plain") and not backends.rows_compiled(self.backend):  # the model may not read rows compiled
            batch = batch.plain()
        elif t == 1 and model.reads_rows_compiled(batch, theta):  # the path is the data's: the same at every step
            self.ran_on = "numba-rows"
        g = self._states.clipped_sum(model, theta, batch)
        theta = self._states.step(g, theta)
        if self.checkpoints is not None:
            before, after = round((t - 1) * self.examples_per_step), round(t * self.examples_per_step)
            self.checkpoints.maybe_record(model, theta, before, after)
        return theta

    def run(self, model: Model, theta: np.ndarray, steps: int) -> np.ndarray:
        """Apply `steps` updates to θ (R, P); a replica that diverges ends as NaN without stopping the others."""
        return run_together(model, [self], [theta], [steps])[0]


def run_together(model: Model, chains: Sequence[GradientChain], thetas: Sequence[np.ndarray],
                 steps: Sequence[int]) -> list[np.ndarray]:
    """Run several chains (same model, data and seeds) in lockstep; each chain's result equals `chain.run`, bit
    for bit: each runs on the backend its plan chooses, chains with the same `stream` key share one batch per step
    (docs/design.md, "Fused tasks")."""
    keys = [chain.stream if chain.stream is not None else ("own", k) for k, chain in enumerate(chains)]
    thetas = [theta.copy() for theta in thetas]
    chosen = [backends.choose(backends.plan(chain, model, theta), chain.backend)
              for chain, theta in zip(chains, thetas)]
    numpy_side = [k for k, b in enumerate(chosen) if b is backends.NUMPY]
    sources: dict[Hashable, Iterator[Batch]] = {}
    runs = []
    for k in [k for k, b in enumerate(chosen) if b is backends.SINGLE_EXAMPLE]:  # each alone on its kernel
        thetas[k], chains[k].ran_on = backends.run_single_example(model, chains[k], thetas[k], steps[k]), "numba"
    mini = [k for k, b in enumerate(chosen) if b is backends.MINI_BATCH]
    for key in dict.fromkeys(keys[k] for k in mini):
        group = [k for k in mini if keys[k] == key]
        out: list[np.ndarray] = []
        run = backends.mini_batch_steps(model, [chains[k] for k in group], [thetas[k] for k in group],
                                        [steps[k] for k in group], out)
        runs.append((group, run, out))
        taken = chains[group[0]].batches
        if any(keys[k] == key for k in numpy_side) and isinstance(taken, IndexedBatches):
            sources[key] = taken.replay(functools.partial(_advance, run))
    full = [k for k, b in enumerate(chosen) if b is backends.FULL_BATCH]
    if full:
        for k, theta in zip(full, backends.run_full_batch(model, [chains[k] for k in full], [thetas[k] for k in full],
                                                          [steps[k] for k in full])):
            thetas[k], chains[k].ran_on = theta, "numba"
    shared: dict[Hashable, Iterator[Batch]] = dict(sources)
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


def _advance(run: Iterator[object]) -> bool:
    """Let a compiled run take its next steps; False once it has finished."""
    return next(run, None) is not None


def _leaders(chains: Sequence[GradientChain], keys: list[Hashable], thetas: list[np.ndarray], steps: Sequence[int],
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


def train_together(model: Model, prepared: Sequence[Prepared]) -> list[Outcome]:
    """Train `Algorithm.prepare` results (same model, data and seeds; streams from one `SharedStreams`, closed)
    in lockstep: their Outcomes, each equal to `fit` alone, bit for bit. E.g. an ε axis of `dp_sgd`:

        streams = SharedStreams(seeds)
        prepared = [DPSGD().prepare(setting_for(eps), model, X, y, streams) for eps in epsilons]
        streams.close()
        outcomes = train_together(model, prepared)
    """
    thetas = run_together(model, [p.chain for p in prepared], [p.theta for p in prepared], [p.steps for p in prepared])
    return [p.finish(theta) for p, theta in zip(prepared, thetas)]
