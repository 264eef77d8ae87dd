"""Where a chain runs: its plan, made once, and the backends that declare which plans they run.

    chain ──plan(chain, model, θ)──▶ Plan(regime, family, dtype, ops) ──choose(plan, backend)──▶ a backend

`NUMPY` runs every plan (the ops' own `update`s, `ops.OpStates.step`). The compiled backends (numba; optional:
`pip install 'dpsgd[numba]'`) compute the clipped gradient sum their way and the rest of the step, the ops after
it, in one shared tail (`_tail_numba.tail`, an int-coded program of the ops, `program`):

* `SINGLE_EXAMPLE` (`_kernels_single_numba`): one example per step cut by index (song2013 with b = 1, bassily2014,
  pidp_sgd), on logistic regression or the one-hidden-layer MLP;
* `MINI_BATCH` (`_kernels_minibatch_numba`): logistic-regression mini-batches cut by index, the cells that share a
  batch stream in one call (each cell's numbers in an order that does not depend on the others);
* `FULL_BATCH` (`_kernels_fullbatch_numba`): logistic regression on the full batch, X read once a step for every
  (cell, replica) column.

These two also run an adaptive clip (`ops.AdaptiveClip`): the kernel counts each replica's unclipped examples as it
clips, `_tail_numba.adaptive_release` adds the sum's noise and moves the replica's norm, kept across calls.

Same random numbers on every backend: the batch indices come from the chain's own sampler (`IndexedBatches.take`)
and the noise from the op's own `draws` iterator, in step order. A seed's run therefore equals the NumPy chain up to
the summation order and the exp (tests: rtol 1e-12); within one backend, fused = alone, bit for bit.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsgd_cli import compiled
from dpsgd_cli.algorithms.ops import (
    Adam,
    AdaptiveClip,
    Clip,
    LaplacianSmoothing,
    MaskedNoise,
    Noise,
    Op,
    ProjectBall,
    ProjectBox,
    Scale,
    Sgd,
    TreeAggregation,
    WeightDecay,
)
from dpsgd_cli.algorithms.sampling import IndexedBatches
from dpsgd_cli.algorithms.streams import NoiseStream
from dpsgd_cli.models import Model
from dpsgd_cli.models.base import FixedGradients
from dpsgd_cli.models.logreg import LogisticRegression
from dpsgd_cli.models.mlp import MLP

if TYPE_CHECKING:
    from dpsgd_cli.algorithms.chain import GradientChain

CHUNK_ELEMENTS = 1 << 23  # noise numbers per kernel call (64 MB in float64): a whole pass on adult / kddcup99
SINGLE_CHUNK_ELEMENTS = 1 << 16  # per single-example call: its noise block stays in cache (measured best)
LANES_FROM = 3  # from this many cells on one batch stream, the mini-batch kernel runs them as vector lanes
MLP_ACTIVATIONS = {"tanh": 0, "sigmoid": 1, "relu": 2}  # the single-example MLP kernel's `act`
NOISE, SCALE, L2, UPDATE, BALL, BOX, ADAM = 1, 2, 3, 4, 5, 6, 7  # the op codes of the tail's program (`program`)
# an `AdaptiveClip`'s fields, in the order `_tail_numba.adaptive_release` reads them (`adaptive_parameters`)
ADAPTIVE_FIELDS = ("noise_multiplier", "quantile", "lr", "count_std", "expected_batch")


class Regime(enum.Enum):
    FULL = "full"  # every example at every step
    INDEXED = "indexed"  # mini-batches cut by index (Poisson, shuffled, fixed)
    SINGLE = "single"  # one example per step, cut by index
    OTHER = "other"


@dataclass(frozen=True)
class Plan:
    """What a backend needs to know of a chain: its batch regime, the model family (`LogisticRegression` or `MLP`
    whose gradient is not overridden, or overridden only by rows of fixed gradient on logistic regression; else
    None), the dtype of θ and the data (None when they differ), its ops, and whether rows of the data have a fixed
    gradient (`Model.fixed_gradients`: the audit's gradient and Dirac canaries)."""

    regime: Regime
    family: type | None
    dtype: np.dtype | None
    ops: tuple[Op, ...]
    fixed: bool = False


def plan(chain: GradientChain, model: Model, theta: np.ndarray) -> Plan:
    batches = chain.batches
    regime, dtype = Regime.OTHER, None
    if isinstance(batches, IndexedBatches):
        regime = (Regime.FULL if batches.full else Regime.SINGLE if chain.examples_per_step == 1
                  and not batches.padded else Regime.INDEXED)
        dtype = theta.dtype if batches.X.dtype == theta.dtype and theta.ndim == 2 else None
    fixed = type(model).fixed_gradients is not Model.fixed_gradients  # the only override the kernels know
    family = next((f for f in (LogisticRegression, MLP) if isinstance(model, f)
                   and (type(model).clipped_grad_sum is f.clipped_grad_sum or fixed and f is LogisticRegression)),
                  None)
    return Plan(regime, family, dtype, tuple(chain.ops), fixed)


# --- the tail's program ---------------------------------------------------------------------------------------------

_CODES: dict[type, tuple[int, tuple[str, ...]]] = {  # op class → (code, the fields of its parameters)
    Noise: (NOISE, ("std",)), MaskedNoise: (NOISE, ("std",)), Scale: (SCALE, ("factor",)),
    WeightDecay: (L2, ("l2",)), Sgd: (UPDATE, ()), ProjectBall: (BALL, ("radius",)), ProjectBox: (BOX, ("radius",)),
    Adam: (ADAM, ("beta1", "beta2", "eps")), TreeAggregation: (NOISE, ("std",))}  # a Noise whose draws are the tree's
PARAMETERS = 3  # the most parameters of an op in the tail's program


def _in_tail(op: Op) -> bool:
    """Whether the tail computes this op (Clip: the kernels' sum; smoothing 0: the identity, left out). By exact
    class: a subclass may compute anything (an adaptive clip moves its norms), so it runs on NumPy."""
    return type(op) in _CODES or type(op) is Clip or (type(op) is LaplacianSmoothing and op.sigma_ls == 0)


def program(ops: Sequence[Op]) -> tuple[np.ndarray, np.ndarray]:
    """(codes (L,) int64, values (L, PARAMETERS) float64, unused ones 0): the ops after the clipped sum, for
    `_tail_numba.tail`."""
    coded = [(_CODES[type(op)][0], [float(getattr(op, name)) for name in _CODES[type(op)][1]])
             for op in ops if type(op) in _CODES]
    values = np.zeros((len(coded), PARAMETERS))
    for k, (_, params) in enumerate(coded):
        values[k, :len(params)] = params
    return np.array([c for c, _ in coded], dtype=np.int64), values


def _compiled_ops(p: Plan, masked: bool, adaptive: bool = False) -> bool:
    """Whether a kernel runs the plan's ops: those the tail codes, at most one noise (a `MaskedNoise` where `masked`,
    an `AdaptiveClip`'s where `adaptive`), its draws taken in blocks."""
    noises = [op for op in p.ops if isinstance(op, (Noise, MaskedNoise, AdaptiveClip))]
    draws = [d for op in noises for d in ((op.draws, op.count_draws) if isinstance(op, AdaptiveClip) else (op.draws,))]
    return (all(_in_tail(op) or (adaptive and type(op) is AdaptiveClip) for op in p.ops) and len(noises) <= 1
            and all(isinstance(d, NoiseStream) for d in draws)
            and (masked or not any(isinstance(op, MaskedNoise) for op in noises)))


# --- the backends ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """A way to run chains: `supports(plan)`, and (compiled) the numba module it loads."""

    name: str
    supports: Callable[[Plan], bool]
    module: str | None = None

    def load(self) -> ModuleType:
        assert self.module is not None
        return _load(f"algorithms.{self.module}")


@functools.cache
def _load(module: str) -> ModuleType:
    """Import the compiled module `dpsgd_cli.<module>` (its kernels compile or load from numba's on-disk cache at
    their first call); a broken numba is a UserError."""
    return compiled.import_compiled(module)


NUMPY = Backend("numpy", lambda p: True)
SINGLE_EXAMPLE = Backend("single_example", lambda p: p.regime is Regime.SINGLE and p.family is not None
                         and not p.fixed and p.dtype == np.float64 and _compiled_ops(p, masked=True),
                         "_kernels_single_numba")
MINI_BATCH = Backend("mini_batch", lambda p: p.regime is Regime.INDEXED and p.family is LogisticRegression
                     and p.dtype == np.float64 and _compiled_ops(p, masked=False, adaptive=not p.fixed),
                     "_kernels_minibatch_numba")
FULL_BATCH = Backend("full_batch", lambda p: p.regime is Regime.FULL and p.family is LogisticRegression
                     and p.dtype == np.float64 and _compiled_ops(p, masked=False, adaptive=not p.fixed),
                     "_kernels_fullbatch_numba")
COMPILED = (SINGLE_EXAMPLE, MINI_BATCH, FULL_BATCH)


# the compiled helpers the chains call beside the backends' kernels: the noise streams' normals (first), the models'
# metrics and row-sparse products
HELPERS = ("algorithms._normals_numba", "models._logreg_numba", "models._mlp_numba", "models._rows_numba")


def warm_up() -> float:
    """Import every compiled module and load the machine code of each kernel numba's disk cache holds (a kernel
    not yet compiled compiles at its first call, as before), so that forked workers inherit them; the seconds it
    took (the benchmark reports it)."""
    start = time.perf_counter()
    helpers = [compiled.import_compiled(name, note=False) for name in HELPERS]
    for module in [backend.load() for backend in COMPILED] + helpers:
        compiled.load_cached_kernels(module)
    normals = helpers[0]
    if normals.fill_normals_pcg64.overloads:  # loaded, not to be compiled here: its check is memoised, inherited too
        normals.pcg64_matches()
    return time.perf_counter() - start


def choose(p: Plan, requested: str) -> Backend:
    """The backend of a chain: NumPy when asked for; else the compiled backend that supports the plan, where numba
    is installed and loads (backend numba: a missing or broken numba is a UserError), else NumPy."""
    compiled.check_backend(requested)
    if requested == "numpy" or not compiled.HAVE_NUMBA:  # looked up here: tests switch it off
        return NUMPY
    for backend in COMPILED:
        if backend.supports(p) and compiled.loads(backend.load, requested == "numba"):
            return backend
    return NUMPY


def rows_compiled(requested: str) -> bool:
    """Whether the NumPy backend's model may read a batch's rows in compiled products (the MLP's row-sparse
    kernels, models/_mlp_numba.py): backend auto or numba, and numba installed."""
    compiled.check_backend(requested)
    return requested != "numpy" and compiled.HAVE_NUMBA


# --- what the compiled backends share -------------------------------------------------------------------------------


def schedule_values(schedule: Callable[..., float], start: int, stop: int) -> np.ndarray:
    """η_t for t = start..stop−1: the schedule applied to an array of t when it is elementwise (`ops.constant`,
    `inverse_sqrt`, `inverse_time`), else called step by step."""
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


def _op(chain: GradientChain, kind: type | tuple[type, ...]) -> Any:
    return next((op for op in chain.ops if isinstance(op, kind)), None)


def _clip_norms(chain: GradientChain, R: int) -> tuple[np.ndarray, bool]:
    """(the per-replica clip norms (R,), whether there is a clip): the `Clip` op's initial state."""
    clip = _op(chain, Clip)
    return (clip.init(np.empty((R, 0))), True) if clip is not None else (np.ones(R), False)


def _step_values(chains: Sequence[GradientChain], start: int, stop: int, running: np.ndarray) -> np.ndarray:
    """(C, m, 3): each chain's (η_t, 1 − β₁ᵗ, 1 − β₂ᵗ) for t = start + 1..stop (the last two 1 without Adam),
    the bias corrections computed as `ops.Adam.update` does."""
    out = np.ones((len(chains), stop - start, 3))
    for c, (chain, on) in enumerate(zip(chains, running)):
        out[c, :, 0] = schedule_values(_op(chain, Sgd).schedule, start + 1, stop + 1) if on else 0.0
        adam = _op(chain, Adam)
        if adam is not None:
            out[c, :, 1] = [1.0 - adam.beta1**t for t in range(start + 1, stop + 1)]
            out[c, :, 2] = [1.0 - adam.beta2**t for t in range(start + 1, stop + 1)]
    return out


def _moments(chains: Sequence[GradientChain], *shape: int) -> tuple[np.ndarray, np.ndarray]:
    """Adam's moments m and v (shape..., P), zero, where a chain has an `Adam` op (else an empty last axis): the
    tail's state, kept across the calls of one run."""
    size = shape[-1] if any(_op(c, Adam) is not None for c in chains) else 0
    return np.zeros((*shape[:-1], size)), np.zeros((*shape[:-1], size))


def checkpoint_stops(chains: Sequence[GradientChain], steps: Sequence[int]) -> tuple[list[set[int]], list[int]]:
    """Each chain's steps after which it records a checkpoint, and every step at which a compiled call must stop (a
    chain's end or one of those records)."""
    records = [set(c.checkpoints.record_steps(c.examples_per_step, s).tolist()) if c.checkpoints else set()
               for c, s in zip(chains, steps)]
    return records, sorted({*steps, *(t for rec in records for t in rec)})


def record_checkpoints(model: Model, chains: Sequence[GradientChain], running: np.ndarray, records: list[set[int]],
                       stop: int,
                       theta_of: Callable[[int], np.ndarray]) -> None:
    """After a compiled call that ended at step `stop`: record each running chain's checkpoint due there."""
    for c, chain in enumerate(chains):
        if running[c] and stop in records[c] and chain.checkpoints is not None:
            e = chain.examples_per_step
            with np.errstate(all="ignore"):
                chain.checkpoints.maybe_record(model, theta_of(c), round((stop - 1) * e), round(stop * e))


def noise_blocks(draws: Sequence[NoiseStream | None], m: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(S, m, R, P) noise blocks of the next m steps, one per distinct stream position (readers of one
    `SharedStreams` stream at the same step read one block), and each chain's slot in it (−1: no noise)."""
    blocks: list[np.ndarray] = []
    seen: dict[tuple[int, int], int] = {}
    slot = np.full(len(draws), -1, dtype=np.int64)
    for c, stream in enumerate(draws):
        if stream is None:
            continue
        key = (id(stream.tape), stream.position)
        if key in seen:
            slot[c] = seen[key]
            stream.skip(m)
        else:
            slot[c] = seen[key] = len(blocks)
            blocks.append(stream.take(m))
    if not blocks:
        return None, slot
    if len(blocks) == 1:  # one stream: its block as it is (a (1, m, R, P) view), not a copy of m·R·P numbers
        return np.ascontiguousarray(blocks[0][None], dtype=np.float64), slot
    return np.ascontiguousarray(np.stack(blocks), dtype=np.float64), slot


def _noise_draws(chain: GradientChain, running: bool = True) -> NoiseStream | None:
    noise = _op(chain, (Noise, MaskedNoise, AdaptiveClip))
    return noise.draws if noise is not None and running else None


def _count_draws(chain: GradientChain, running: bool = True) -> NoiseStream | None:
    """The count's noise of an adaptive clip (None: the clip norm stays)."""
    clip = _op(chain, AdaptiveClip)
    return clip.count_draws if clip is not None and running else None


def adaptive_parameters(chains: Sequence[GradientChain]) -> np.ndarray:
    """(C, 5): each chain's `AdaptiveClip` fields (`ADAPTIVE_FIELDS`), zero without one."""
    out = np.zeros((len(chains), len(ADAPTIVE_FIELDS)))
    for c, chain in enumerate(chains):
        clip = _op(chain, AdaptiveClip)
        if clip is not None:
            out[c] = [float(getattr(clip, name)) for name in ADAPTIVE_FIELDS]
    return out


_NO_NOISE = np.zeros((1, 1, 1, 1))


def fixed_arguments(fixed: FixedGradients | None, rows: np.ndarray | None, replicas: int,
                    *proj_shape: int) -> tuple[Any, ...]:
    """The kernels' `fixed` argument: (rows, weight (replicas, m), idx, val, raw norm, zeroed projections `proj_shape`
    + (m,)), `rows` empty and the rest dummies without rows of fixed gradient."""
    if fixed is None or rows is None:
        return np.zeros(0, dtype=np.int64), np.zeros((1, 1)), np.zeros((1, 1), dtype=np.int64), np.zeros((1, 1)), \
            0.0, np.zeros((*[1] * len(proj_shape), 1))
    if fixed.weight.shape != (replicas, fixed.idx.shape[0]):  # the kernels index it unchecked
        raise ValueError(f"fixed-gradient weights {fixed.weight.shape}, not one per replica ({replicas}) and row")
    idx, val = np.ascontiguousarray(fixed.idx, dtype=np.int64), np.ascontiguousarray(fixed.val, dtype=np.float64)
    return (rows, np.ascontiguousarray(fixed.weight, dtype=np.float64), idx, val, float(fixed.raw_norm),
            np.zeros((*proj_shape, idx.shape[0])))


# --- the single-example backend -------------------------------------------------------------------------------------


def run_single_example(model: Model, chain: GradientChain, theta: np.ndarray, steps: int) -> np.ndarray:
    """`steps` steps of a chain `SINGLE_EXAMPLE` supports, replica by replica: the chain's indices (`take`n), its
    noise steps and, for a `MaskedNoise`, its mask. θ is not modified; the result is returned."""
    nb = SINGLE_EXAMPLE.load()
    batches = chain.batches
    assert isinstance(batches, IndexedBatches)  # supports(plan) took only chains cut by index
    theta = np.array(theta, copy=True, order="C")
    X, y, x_norm = np.ascontiguousarray(batches.X), np.ascontiguousarray(batches.y), batches.x_norm
    R, P = theta.shape
    clip, do_clip = _clip_norms(chain, R)
    codes, vals = program(chain.ops)
    masked = _op(chain, MaskedNoise)
    extra: tuple[int, ...] = ()
    if isinstance(model, MLP):
        kernel, extra = nb.sgd1_mlp, (model.hidden, MLP_ACTIVATIONS[model.activation])
    else:
        kernel = nb.sgd1_logreg
    records, stops = checkpoint_stops([chain], [steps])
    moments = _moments([chain], R, P)
    chunk = max(64, SINGLE_CHUNK_ELEMENTS // max(1, R * P))
    done = 0
    while done < steps:
        stop = min(done + chunk, min(s for s in stops if s > done))
        m = stop - done
        idx = np.ascontiguousarray(batches.take(m)[:, :, 0], dtype=np.int64)
        noise, _ = noise_blocks([_noise_draws(chain)], m)
        noise = noise[0] if noise is not None else _NO_NOISE[0]
        noisy = (np.ascontiguousarray(masked.noisy[done:stop], dtype=np.bool_) if masked is not None
                 else np.ones((m, R), dtype=np.bool_))
        lrs = _step_values([chain], done, stop, np.ones(1, dtype=bool))[0]
        kernel(theta, X, y, x_norm, idx, noise, noisy, lrs, clip, do_clip, codes, vals, *moments, *extra)
        record_checkpoints(model, [chain], np.ones(1, dtype=bool), records, stop, lambda c: theta)
        done = stop
    return theta


# --- the mini-batch backend -----------------------------------------------------------------------------------------


def lane_cells(C: int) -> int:
    """How many of C cells on one stream the kernel runs as vector lanes (8 a block): all from LANES_FROM on, but
    fewer than LANES_FROM left over a whole block take the pair path (a block costs about 2–3 cells' pairs)."""
    if C < LANES_FROM:
        return 0
    rest = C % 8
    return C - rest if rest < LANES_FROM else C


def _programs(chains: Sequence[GradientChain]) -> tuple[np.ndarray, np.ndarray]:
    """The chains' tail programs padded to one length (code 0: no op)."""
    progs = [program(c.ops) for c in chains]
    L = max(1, max(len(codes) for codes, _ in progs))
    codes, vals = np.zeros((len(chains), L), dtype=np.int64), np.zeros((len(chains), L, PARAMETERS))
    for c, (code, val) in enumerate(progs):
        codes[c, :len(code)], vals[c, :len(val)] = code, val
    return codes, vals


def mini_batch_steps(model: Model, chains: Sequence[GradientChain], thetas: Sequence[np.ndarray],
                     steps: Sequence[int], out: list[np.ndarray]) -> Iterator[int]:
    """Run chains that share one batch stream (`MINI_BATCH` supports each) for their `steps`, one kernel call at a
    time: yields the steps done after each call; the results are appended to `out` at the end (so a NumPy chain
    on the same stream can replay the batches as they are taken)."""
    kernel = MINI_BATCH.load().mb_logreg
    batches = chains[0].batches
    assert isinstance(batches, IndexedBatches)  # supports(plan) took only chains cut by index
    X, y = np.ascontiguousarray(batches.X), np.ascontiguousarray(batches.y)
    C, (R, d) = len(chains), thetas[0].shape
    norms = [_clip_norms(c, R) for c in chains]
    # only the clip reads ‖x_i‖, but the kernel's branch-free residual indexes it for every row: full length
    x_norm = batches.x_norm if any(do for _, do in norms) else np.zeros(X.shape[0])
    nonzeros = batches.nonzeros()  # rows read by their nonzeros when X is sparse (their own fixed order), less work
    P = nonzeros.packed if nonzeros is not None else np.zeros((0, 0), dtype=np.uint64)
    TH = np.ascontiguousarray(np.stack(thetas).astype(np.float64))  # (C, R, d)
    clip = np.ascontiguousarray(np.stack([n for n, _ in norms]))  # (C, R)
    do_clip = np.array([do for _, do in norms])
    codes, vals = _programs(chains)
    adapt = adaptive_parameters(chains)
    M1, M2 = _moments(chains, C, R, d)
    fixed = model.fixed_gradients(batches.y, batches.x_norm)
    rows = np.ascontiguousarray(fixed.row, dtype=np.int64) if fixed is not None else None
    records, stops = checkpoint_stops(chains, steps)
    width = max(1, round(float(np.mean([c.examples_per_step for c in chains])) * 2))
    chunk = max(64, CHUNK_ELEMENTS // max(1, R * (width + d * C)))
    done = 0
    while done < max(steps, default=0):
        stop = min(done + chunk, min(s for s in stops if s > done))
        active = np.array([s > done for s in steps])
        idx = batches.take(stop - done)
        noise, slot = noise_blocks([_noise_draws(c, a) for c, a in zip(chains, active)], stop - done)
        counts, count_slot = noise_blocks([_count_draws(c, a) for c, a in zip(chains, active)], stop - done)
        arrays = fixed_arguments(fixed, rows, R, C, stop - done, R)
        kernel(TH, active, X, P, y, x_norm, idx, noise if noise is not None else _NO_NOISE, slot, clip, do_clip,
               codes, vals, _step_values(chains, done, stop, active), lane_cells(C), M1, M2,
               counts if counts is not None else _NO_NOISE[0], count_slot, adapt, arrays)
        if fixed is not None:
            for c, on in enumerate(active):
                if on:
                    fixed.record(arrays[-1][c])
        record_checkpoints(model, chains, active, records, stop, lambda c: TH[c])
        done = stop
        yield done
    for c, chain in enumerate(chains):  # where the kernel moved the adaptive clips' norms (`clip_norms` reads them)
        if _op(chain, AdaptiveClip) is not None:
            chain.set_clip_norms(clip[c], thetas[c])
    out.extend(TH[c].astype(theta.dtype, copy=True) for c, theta in enumerate(thetas))


# --- the full-batch backend -----------------------------------------------------------------------------------------


def run_full_batch(model: Model, chains: Sequence[GradientChain], thetas: Sequence[np.ndarray],
                   steps: Sequence[int]) -> list[np.ndarray]:
    """Run full-batch chains (`FULL_BATCH` supports each; same X and y) for their `steps` in one kernel call per
    chunk: their θ, each the same bit for bit whatever the other chains."""
    nb = FULL_BATCH.load()
    batches = chains[0].batches
    assert isinstance(batches, IndexedBatches)  # supports(plan) took only chains cut by index
    X, y = np.ascontiguousarray(batches.X), np.ascontiguousarray(batches.y)
    R, d = thetas[0].shape
    cols = [(c, r) for c in range(len(chains)) for r in range(R)]
    K = -(-len(cols) // nb.LANES) * nb.LANES  # padded: the extra columns stay 0 and are never updated
    col_chain = np.array([c for c, _ in cols] + [0] * (K - len(cols)), dtype=np.int64)
    rep = np.array([r for _, r in cols] + [0] * (K - len(cols)), dtype=np.int64)
    real = np.arange(K) < len(cols)
    TH = np.zeros((d, K))
    for k, (c, r) in enumerate(cols):
        TH[:, k] = thetas[c][r]
    norms = [_clip_norms(c, R) for c in chains]
    clip = np.array([norms[c][0][r] for c, r in cols] + [1.0] * (K - len(cols)))
    do_clip = np.array([norms[c][1] for c, _ in cols] + [False] * (K - len(cols)))
    codes, vals = _programs(chains)
    adapt = adaptive_parameters(chains)
    M1, M2 = _moments(chains, K, d)
    fixed = model.fixed_gradients(y, batches.x_norm)
    fixed_counts = None  # every row is in every step's batch: X's rows of each fixed gradient
    if fixed is not None:
        fixed_counts = np.bincount(fixed.row[fixed.row >= 0], minlength=fixed.idx.shape[0]).astype(np.float64)
    records, stops = checkpoint_stops(chains, steps)
    chunk = max(1, CHUNK_ELEMENTS // max(1, len(chains) * R * d))
    G, S, A, U = np.zeros((d, K)), np.zeros(K), np.zeros((nb.ROWS, K)), np.zeros(K)
    done = 0
    while done < max(steps, default=0):
        stop = min(done + chunk, min(s for s in stops if s > done))
        running = np.array([s > done for s in steps])
        noise, slot = noise_blocks([_noise_draws(c, a) for c, a in zip(chains, running)], stop - done)
        counts, count_slot = noise_blocks([_count_draws(c, a) for c, a in zip(chains, running)], stop - done)
        lrs = _step_values(chains, done, stop, running)
        arrays = fixed_arguments(fixed, fixed_counts, R, stop - done, K)
        nb.gd_logreg(TH, X, y, batches.x_norm, clip, do_clip, codes[col_chain], vals[col_chain], slot[col_chain],
                     rep, noise if noise is not None else _NO_NOISE, np.ascontiguousarray(lrs[col_chain]),
                     real & running[col_chain], G, S, A, M1, M2, counts if counts is not None else _NO_NOISE[0],
                     count_slot[col_chain], adapt[col_chain], U, arrays)
        if fixed is not None:
            for c, on in enumerate(running):
                if on:
                    fixed.record(arrays[-1][:, c * R:(c + 1) * R])
        record_checkpoints(model, chains, running, records, stop,
                           lambda c: np.ascontiguousarray(TH[:, c * R:(c + 1) * R].T))
        done = stop
    for c, chain in enumerate(chains):  # where the kernel moved the adaptive clips' norms (`clip_norms` reads them)
        if _op(chain, AdaptiveClip) is not None:
            chain.set_clip_norms(clip[c * R:(c + 1) * R], thetas[c])
    return [np.ascontiguousarray(TH[:, c * R:(c + 1) * R].T).astype(theta.dtype, copy=False)
            for c, theta in enumerate(thetas)]
