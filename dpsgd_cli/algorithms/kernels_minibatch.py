"""The compiled mini-batch step of logistic-regression chains (numba; optional: `pip install 'dpsgd[numba]'`).

`dp_sgd`, `sgd` and `song2013` with b > 1 on `LogisticRegression` are `GradientChain`s whose NumPy step is
~15–20 array calls from Python, most of its time overhead. `mb_logreg` runs many steps per call, reading
the batch rows from X by index (no gather), for every chain that shares the batch stream (a fused task):

    for each replica r and step t:  for each row i of the step's batch, for each chain c:
        a   = −y σ(−y θ_c·x_i)                                    (∇ℓ = a x, logistic loss)
        a  ← a · C_c / max(|a|‖x_i‖, C_c)                          (clip; skipped when clip is None)
        g_c += a x_i
    then for each chain c:  g = ((g_c + s_c z_c,t) · scale_c) + λ_c θ_c;  θ_c ← θ_c − η_c,t g;  θ_c ← Π_c(θ_c)

operation for operation the chain's `clipped_grad_sum` → `add_noise(s)` → `scale` → `add_l2` → schedule →
`project_to_ball` (the transforms say what they compute, `GradientChain.ops`). Same random numbers:
the batch indices come from the chain's own sampler (`sampling.IndexedBatches.take`: the same blocks, Poisson
gaps, permutations or the full batch) and the noise from the chain's own `draws` iterator (streams.per_step /
`SharedStreams`: float64 blocks), so a seed gives the same run on both paths, equal up to the summation order
and the exp (tests/test_kernels_minibatch.py asserts rtol 1e-12).

Fused = alone, bit for bit, on this path: each chain's dot product θ_c·x_i is summed in a fixed order (dense
rows: eight interleaved partial sums over the features, lane p of one 8-wide vector summing the j ≡ p mod 8, then
a fixed tree, then the tail; rows read by their nonzeros: the nonzeros one after the other in column order), its
residual uses `exp_fixed` (+, ×, floor and a bit cast only: the same bits in a vector
lane as in scalar code, ≤ 1 ulp from libm's exp) and its g_c adds the rows in batch order, whatever the other
chains of the call. From LANES_FROM chains on a stream the chains are the kernel's vector lanes (θ held as
feature × chain, 8 chains a block, two rows at a time: each X[i, j] read once for all of them); fewer take the
pair path (PAIRS (row, chain) dot products together). Both compute each chain's numbers in the same order, so the
path changes only the time (tests/test_kernels_minibatch.py: every cell alone = among 3 … 17 cells, both paths).
Chains of one fused task that share a seed's noise stream share the noise block (the same draws,
`SharedStreams`, detected by identity).

Applies (`applies`): backend not "numpy"; numba installed (backend "numba" without it: UserError); a
`LogisticRegression` whose `clipped_grad_sum` is not overridden (not the audit's canary models); float64 data
and θ; a sampler that is an `IndexedBatches` (Poisson, shuffled, full batch); transforms an ordered subset of
(noise, scale, l2) and identities (dp_lssgd's smoothing 0); the projection none or `project_to_ball`; any
schedule (`kernels.schedule_values`); checkpoints (the kernel stops at each step that records one). Everything
else keeps the NumPy chain.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import numpy as np

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import kernels
from dpsgd_cli.algorithms.kernels import CHUNK_ELEMENTS, schedule_values
from dpsgd_cli.algorithms.sampling import IndexedBatches

ORDER = ("noise", "scale", "l2")  # the kernel's order of the transforms
LANES_FROM = 3  # from this many cells on one batch stream, they are the kernel's vector lanes (measured best)


def lane_cells(C: int) -> int:
    """How many of C cells on one stream the kernel runs as vector lanes (8 a block): all from LANES_FROM on, but
    fewer than LANES_FROM left over a whole block take the pair path (a block costs about 2–3 cells' pairs)."""
    if C < LANES_FROM:
        return 0
    rest = C % 8
    return C - rest if rest < LANES_FROM else C


@functools.lru_cache(maxsize=1)
def _kernel():
    """Compile (or load from numba's on-disk cache) the kernel (`_kernels_minibatch_numba.mb_logreg`); imports numba."""
    return compiled.import_compiled("algorithms._kernels_minibatch_numba").mb_logreg


def _plan(chain) -> dict | None:
    """The chain's step as the kernel's parameters, or None when it has a part the kernel does not compute."""
    params: dict = {"noise": None, "scale": 1.0, "l2": 0.0}
    ops, at = chain.ops(), 0
    for kind, *values in ops if ops is not None else [("opaque",)]:
        if kind not in ORDER[at:]:
            return None
        at = ORDER.index(kind) + 1
        params[kind] = tuple(values) if kind == "noise" else float(values[0] or 0.0)
    try:
        params["radius"] = chain.ball_radius()
    except ValueError:
        return None
    return params


def _accepted_plan(chain) -> dict:
    """`_plan` of a chain that `applies` accepted."""
    plan = _plan(chain)
    if plan is None:
        raise ValueError("the chain has a part the compiled mini-batch step does not compute (see `applies`)")
    return plan


def applies(model, chains: Sequence, thetas: Sequence[np.ndarray]) -> bool:
    """Whether these chains (one batch stream) run on the compiled step (module docstring)."""
    if any(chain.backend == "numpy" for chain in chains):
        return False
    for chain in chains:
        compiled.check_backend(chain.backend)
    wanted = any(chain.backend == "numba" for chain in chains)
    if not compiled.HAVE_NUMBA:  # looked up here: tests switch it off
        return False
    if not (kernels.plain_logreg_float64(model, chains[0].batches, thetas)
            and all(_plan(chain) is not None for chain in chains)):
        return False
    return compiled.loads(_kernel, wanted)


def group_steps(model, chains: Sequence, thetas: Sequence[np.ndarray], steps: Sequence[int],
                out: list) -> Iterator[int]:
    """Run chains that share one batch stream (`applies`) for their `steps` on the kernel, one kernel call at a
    time: yields the steps done after each call; the results are appended to `out` at the end (so a NumPy chain
    on the same stream can replay the batches as they are taken). Each result equals its `chain.run` (NumPy) up
    to summation order, and is the same bit for bit whatever the other chains."""
    batches: IndexedBatches = chains[0].batches
    X, y = np.ascontiguousarray(batches.X), np.ascontiguousarray(batches.y)
    # only the clip reads ‖x_i‖, but the kernel's branch-free residual indexes it for every row: full length
    x_norm = batches.x_norm if any(c.clip is not None for c in chains) else np.zeros(X.shape[0])
    nonzeros = batches.nonzeros()  # rows read by their nonzeros when X is sparse (their own fixed order), less work
    P = nonzeros.packed if nonzeros is not None else np.zeros((0, 0), dtype=np.uint64)
    plans = [_accepted_plan(chain) for chain in chains]
    C, (R, d) = len(chains), thetas[0].shape
    TH = np.ascontiguousarray(np.stack(thetas).astype(np.float64))  # (C, R, d)
    std = np.array([p["noise"][0] if p["noise"] else 0.0 for p in plans], dtype=np.float64)
    scale = np.array([p["scale"] for p in plans], dtype=np.float64)
    l2 = np.array([p["l2"] for p in plans], dtype=np.float64)
    clip = np.array([c.clip if c.clip is not None else 1.0 for c in chains], dtype=np.float64)
    do_clip = np.array([c.clip is not None for c in chains])
    radius = np.array([p["radius"] or 1.0 for p in plans], dtype=np.float64)
    do_project = np.array([p["radius"] is not None for p in plans])
    records, stops = kernels.checkpoint_stops(chains, steps)
    lanes = lane_cells(C)
    no_idx, no_noise = np.zeros((1, 1, 1), dtype=np.int64), np.zeros((1, 1, 1, 1))
    kernel = _kernel()
    width = 1 if batches.full else max(1, round(float(np.mean([c.examples_per_step for c in chains])) * 2))
    chunk = max(64, CHUNK_ELEMENTS // max(1, R * (width + d * C)))
    done = 0
    while done < max(steps, default=0):
        stop = min(done + chunk, min(s for s in stops if s > done))
        m = stop - done
        active = np.array([s > done for s in steps])
        idx = no_idx if batches.full else batches.take(m)
        noise, slot = noise_blocks([p["noise"][1] if p["noise"] and a else None for p, a in zip(plans, active)], m)
        lrs = np.stack([schedule_values(c.schedule, done + 1, stop + 1) if a else np.zeros(m)
                        for c, a in zip(chains, active)])
        kernel(TH, active, X, P, y, x_norm, idx, batches.full, noise if noise is not None else no_noise, slot, std,
               scale, l2, clip, do_clip, lrs, radius, do_project, lanes)
        kernels.record_checkpoints(model, chains, active, records, stop, lambda c: TH[c])
        done = stop
        yield done
    out.extend(TH[c].astype(theta.dtype, copy=True) for c, theta in enumerate(thetas))


def noise_blocks(draws: Sequence[Iterator | None], m: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(S, m, R, d) noise blocks of the next m steps, one per distinct draws iterator (tee copies of one
    `SharedStreams` stream yield the same arrays: read once), and each chain's slot in it (−1: `draws[c]` is
    None, no noise). Shared by the mini-batch and full-batch compiled steps."""
    blocks: list[np.ndarray] = []
    firsts: list[list[np.ndarray]] = []
    slot = np.full(len(draws), -1, dtype=np.int64)
    for c, chain_draws in enumerate(draws):
        if chain_draws is None:
            continue
        steps = [next(chain_draws) for _ in range(m)]
        for s, seen in enumerate(firsts):
            if all(a is b for a, b in zip(steps, seen)):
                slot[c] = s
                break
        else:
            slot[c] = len(blocks)
            firsts.append(steps)
            blocks.append(np.stack(steps))
    if not blocks:
        return None, slot
    return np.ascontiguousarray(np.stack(blocks), dtype=np.float64), slot
