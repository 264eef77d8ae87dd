"""The compiled full-batch step of logistic-regression chains (numba; optional: `pip install 'dpsgd[numba]'`).

`noisy_gd` is full-batch gradient descent: every step reads all of X for every replica (and, fused, every cell).
The NumPy chain does a gemv per replica and step (X read R times a step, memory-bound); one gemm over the
replicas would read it once but OpenBLAS rounds a row of a gemm differently with the number of rows
(docs/design.md, the bit-for-bit rule). `gd_logreg` (_kernels_fullbatch_numba.py) reads each row
of X once a step for all the (chain, replica) columns of the call, and computes each column's numbers in an order
that does not depend on the others (a plain sum over the features for θ·x, over the rows for the gradient; the loops
across columns are elementwise, vectorised without reassociation):

    for each row i:  for each column k:  a_k = −y σ(−y θ_k·x_i);  a_k ← a_k C / max(|a_k|‖x_i‖, C);  g_k += a_k x_i
    then for each column: g ← the chain's transforms in its order (noise, scale, λθ: any order, e.g. noisy_gd's
    scale → λθ → noise); θ ← θ − η_t g; θ ← Π(θ)

Same random numbers as the NumPy chain: the noise from the chain's own `draws` iterator (shared draws of a fused
task, `SharedStreams`, read once), the full batch has none. So a seed's run equals the NumPy chain up to summation
order (tests/test_kernels_fullbatch.py: rtol 1e-12) and is the same bit for bit whatever else shares the call.

Applies (`applies`), to chains the mini-batch kernel (kernels_minibatch) does not take: backend not "numpy";
numba installed (backend "numba" without it: UserError); a `LogisticRegression` whose `clipped_grad_sum` is not
overridden; float64 data and θ; the full batch (`IndexedBatches.full`); transforms tagged noise/scale/l2/identity
(`GradientChain.ops`) in any order; the projection none or `project_to_ball`; any schedule; checkpoints (the kernel
stops at each step that records one).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import kernels
from dpsgd_cli.algorithms.kernels import CHUNK_ELEMENTS, schedule_values
from dpsgd_cli.algorithms.kernels_minibatch import noise_blocks
from dpsgd_cli.algorithms.sampling import IndexedBatches

CODES = {"noise": 1, "scale": 2, "l2": 3}  # _kernels_fullbatch_numba's op codes


@functools.lru_cache(maxsize=1)
def _module():
    """Import (compile or load from numba's on-disk cache) the kernel module; imports numba."""
    return compiled.import_compiled("algorithms._kernels_fullbatch_numba")


def _ops(chain) -> list[tuple] | None:
    """The chain's transforms as (kind, *params), or None if one is not a kind the kernel computes."""
    ops = chain.ops()
    if ops is None or any(op[0] not in CODES for op in ops):
        return None
    return ops if sum(op[0] == "noise" for op in ops) <= 1 else None


def _accepted_ops(chain) -> list[tuple]:
    """`_ops` of a chain that `applies` accepted."""
    ops = _ops(chain)
    if ops is None:
        raise ValueError("the chain has a transform the compiled full-batch step does not compute (see `applies`)")
    return ops


def _radius(chain) -> float | None:
    return chain.ball_radius()


def applies(model, chain, theta: np.ndarray) -> bool:
    """Whether this chain runs on the compiled full-batch step (module docstring)."""
    if chain.backend == "numpy":
        return False
    compiled.check_backend(chain.backend)
    batches = chain.batches
    if not (compiled.HAVE_NUMBA and kernels.plain_logreg_float64(model, batches, [theta]) and batches.full
            and _ops(chain) is not None
            and (chain.project is None or getattr(chain.project, "kind", "") == "ball")):
        return False
    return compiled.loads(_module, chain.backend == "numba")


def run(model, chains: Sequence, thetas: Sequence[np.ndarray], steps: Sequence[int]) -> list[np.ndarray]:
    """Run full-batch chains (`applies`; same X and y) for their `steps` in one kernel call per chunk: their θ,
    each equal to its `chain.run` (NumPy) up to summation order, bit for bit the same whatever the other chains."""
    nb = _module()
    batches: IndexedBatches = chains[0].batches
    X, y = np.ascontiguousarray(batches.X), np.ascontiguousarray(batches.y)
    x_norm = batches.x_norm
    R, d = thetas[0].shape
    cols = [(c, r) for c in range(len(chains)) for r in range(R)]
    K = -(-len(cols) // nb.LANES) * nb.LANES  # padded: the extra columns stay 0 and are never updated
    col_chain = np.array([c for c, _ in cols] + [0] * (K - len(cols)), dtype=np.int64)
    real = np.arange(K) < len(cols)
    TH = np.zeros((d, K))
    for k, (c, r) in enumerate(cols):
        TH[:, k] = thetas[c][r]
    ops = [_accepted_ops(chain) for chain in chains]
    L = max(1, max(len(o) for o in ops))
    code = np.zeros((len(chains), L), dtype=np.int64)
    val = np.zeros((len(chains), L))
    for c, chain_ops in enumerate(ops):
        for o, (kind, *params) in enumerate(chain_ops):
            code[c, o], val[c, o] = CODES[kind], float(params[0] or 0.0)
    clip = np.array([ch.clip if ch.clip is not None else 1.0 for ch in chains], dtype=np.float64)[col_chain]
    do_clip = np.array([ch.clip is not None for ch in chains])[col_chain]
    radius = np.array([_radius(ch) or 1.0 for ch in chains])[col_chain]
    do_project = np.array([ch.project is not None for ch in chains])[col_chain]
    rep = np.array([r for _, r in cols] + [0] * (K - len(cols)), dtype=np.int64)
    records, stops = kernels.checkpoint_stops(chains, steps)
    chunk = max(1, CHUNK_ELEMENTS // max(1, len(chains) * R * d))
    G, S, A = np.zeros((d, K)), np.zeros(K), np.zeros((nb.ROWS, K))
    done = 0
    while done < max(steps, default=0):
        stop = min(done + chunk, min(s for s in stops if s > done))
        m = stop - done
        running = np.array([s > done for s in steps])
        noise, slot = noise_blocks([next((op[2] for op in chain_ops if op[0] == "noise"), None) if run else None
                                    for chain_ops, run in zip(ops, running)], m)
        slot = np.maximum(slot, 0)  # a chain without noise never reads its slot
        noise = noise if noise is not None else np.zeros((1, 1, 1, 1))
        lrs = np.stack([schedule_values(ch.schedule, done + 1, stop + 1) if a else np.zeros(m)
                        for ch, a in zip(chains, running)])
        nb.gd_logreg(TH, X, y, x_norm, clip, do_clip, code[col_chain], val[col_chain], slot[col_chain], rep, noise,
                     np.ascontiguousarray(lrs[col_chain]), radius, do_project, real & running[col_chain], G, S, A)
        kernels.record_checkpoints(model, chains, running, records, stop,
                                   lambda c: np.ascontiguousarray(TH[:, c * R:(c + 1) * R].T))
        done = stop
    return [np.ascontiguousarray(TH[:, c * R:(c + 1) * R].T).astype(theta.dtype, copy=False)
            for c, theta in enumerate(thetas)]
