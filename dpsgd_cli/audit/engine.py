"""Audit a grid: for every cell, train N replicas with the canary and N without, score them, bound ε from below.

The two worlds differ in one record only, and their replicas are
seeds of one chain: the input canary trains the two worlds as two vectorised fits, the gradient canary as one
(its inclusion is a per-replica mask). Nothing here changes how an algorithm trains.

The record in the canary's place is the worst-case neighbour of the algorithm's privacy claim
(`Algorithm.neighbouring`): under add/remove, the null record (zero gradient: the canary removed); under
replace-one, the canary's mirror image (label flipped; gradient −C·u), so the two worlds' gradients differ by 2C,
the sensitivity the replace-one accountants are calibrated for.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Iterator, Optional

import numpy as np

from dpsgd_cli.algorithms import Algorithm, Setting
from dpsgd_cli.algorithms.erm import reference_minimum
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.audit import canaries, stats
from dpsgd_cli.config import AuditSpec, Cell
from dpsgd_cli.data import Dataset
from dpsgd_cli.engine.runner import dataset, setting_of
from dpsgd_cli.models import Model, make_model

COLUMNS = ["grid", "cell_id", "dataset", "model", "algorithm", "algorithm_params", "epsilon", "epsilon_claimed",
           "delta", "epsilon_lo", "epsilon_rdp", "noiseless_fraction", "confidence", "statistic", "threshold", "auc",
           "tpr_at_fpr_1e-2", "tpr_at_fpr_1e-3", "trials", "canary", "threat_model", "neighbours", "batch_size", "lr", "epochs",
           "steps", "sigma", "guarantee", "wall_time", "status", "message"]
THREATS = {"input": ["black-box, last iterate"],
           "gradient": ["white-box, last iterate", "white-box, all iterates"]}


@dataclasses.dataclass
class Worlds:
    """Scores of the trials with the canary (`inp`) and without (`out`), per threat model, and what the runs
    derived (σ, the achieved ε, ...)."""

    scores: dict[str, tuple[np.ndarray, np.ndarray]]
    derived: dict[str, Any]
    guarantee: str


class NotApplicable(ValueError):
    """This canary cannot be planted in this algorithm (the row says so; not a failure)."""


def audit_cell(cell: Cell, spec: AuditSpec, trials: Optional[int] = None, confidence: Optional[float] = None,
               algorithm: Optional[Algorithm] = None, data: Optional[Dataset] = None) -> list[dict[str, Any]]:
    """Rows of audit.csv for one cell: one per threat model of each canary kind. `algorithm` and `data` replace
    the cell's (tests: a deliberately broken variant, a dataset built in the test)."""
    trials = trials or spec.trials
    confidence = confidence or spec.confidence
    algorithm = algorithm or cell.make_algorithm()
    data = data or dataset(cell.dataset)
    base = _base_row(cell, data, algorithm, trials, confidence, spec)
    rows = []
    for kind in spec.canaries:
        start = time.perf_counter()
        try:
            worlds = (input_worlds if kind == "input" else gradient_worlds)(cell, spec, algorithm, trials, data)
        except Exception as exc:  # recorded, the audit goes on
            status = "not applicable" if isinstance(exc, NotApplicable) else "failed"
            rows += [{**base, "canary": kind, "threat_model": t, "status": status,
                      "message": f"{type(exc).__name__}: {exc}".replace("\n", " ")} for t in THREATS[kind]]
            continue
        elapsed = time.perf_counter() - start
        for threat, (s_in, s_out) in worlds.scores.items():
            rows.append({**base, **_derived_columns(worlds, cell, data), "canary": kind, "threat_model": threat,
                         "wall_time": elapsed, **_statistics(s_in, s_out, spec, confidence, worlds)})
    return rows


def _base_row(cell: Cell, data: Dataset, algorithm: Algorithm, trials: int, confidence: float, spec: AuditSpec) -> dict:
    return {"grid": cell.grid, "cell_id": cell.cell_id, "dataset": data.name, "model": cell.model.name,
            "algorithm": algorithm.name, "algorithm_params": json.dumps(cell.algorithm.params, sort_keys=True),
            "epsilon": cell.epsilon, "trials": trials, "confidence": confidence, "statistic": spec.statistic,
            "neighbours": algorithm.neighbouring(),
            "threshold": spec.threshold if spec.statistic == "clopper_pearson" else "bonferroni",
            "batch_size": cell.batch_size, "lr": cell.lr, "epochs": cell.epochs, "status": "ok", "message": ""}


def _derived_columns(worlds: Worlds, cell: Cell, data: Dataset) -> dict[str, Any]:
    d = worlds.derived
    claimed = d.get("epsilon_achieved")
    claimed = cell.epsilon if claimed is None else claimed  # a calibration that proves nothing: the target ε
    delta = d.get("delta_achieved", setting_of(cell, data).delta)  # song2013 (basic composition): pure, δ = 0
    return {"epsilon_claimed": claimed, "delta": delta, "steps": d.get("steps"), "sigma": d.get("sigma"),
            "epsilon_rdp": d.get("epsilon_rdp"),  # bassily2014: what RDP certifies for the σ used
            "noiseless_fraction": d.get("noiseless_fraction_mean"),  # pidp_sgd: steps that skipped the noise
            "guarantee": worlds.guarantee}


def _statistics(s_in: np.ndarray, s_out: np.ndarray, spec: AuditSpec, confidence: float, worlds: Worlds) -> dict:
    delta = worlds.derived.get("_delta_audit", 0.0)
    finite = np.isfinite(s_in).all() and np.isfinite(s_out).all()
    if not finite:
        keep_in, keep_out = s_in[np.isfinite(s_in)], s_out[np.isfinite(s_out)]
        return {"status": "diverged", "message": f"{s_in.size - keep_in.size + s_out.size - keep_out.size} "
                "replicas diverged (non-finite scores); no bound", "epsilon_lo": None}
    if spec.statistic == "one_run":
        eps = stats.epsilon_one_run(s_in, s_out, confidence, delta)
    else:
        eps = stats.epsilon_clopper_pearson(s_in, s_out, confidence, delta, spec.threshold)
    return {"epsilon_lo": eps, "auc": stats.auc(s_in, s_out), "tpr_at_fpr_1e-2": stats.tpr_at_fpr(s_in, s_out, 1e-2),
            "tpr_at_fpr_1e-3": stats.tpr_at_fpr(s_in, s_out, 1e-3)}


def _chunks(seeds: range, size: int) -> Iterator[range]:
    for start in range(seeds.start, seeds.stop, size):
        yield range(start, min(start + size, seeds.stop))


def _setup(cell: Cell, data: Dataset, extra_rows: int) -> tuple[Model, Setting]:
    model = make_model(cell.model.name, data.d, cell.l2, cell.model.options)
    setting = setting_of(cell, data)
    full = setting.batch_size == data.n  # a full batch stays full (q = 1) with the canary rows
    setting = dataclasses.replace(setting, n=data.n + extra_rows, trace_every=None,
                                  batch_size=data.n + extra_rows if full else setting.batch_size)
    return model, setting


def _fit(algorithm: Algorithm, setting: Setting, model: Model, X, y, seeds: range):
    outcome = algorithm.fit(setting, model, X, y, ReplicaStreams(seeds))
    derived = dict(outcome.derived)
    derived["_delta_audit"] = derived.get("delta_achieved", setting.delta)
    return outcome, derived


def input_worlds(cell: Cell, spec: AuditSpec, algorithm: Algorithm, trials: int, data: Dataset) -> Worlds:
    """Black box: D ∪ {(x_c, y_c)} against D ∪ {(0, 0)} (add/remove) or D ∪ {(x_c, −y_c)} (replace-one); score =
    the released model's margin on the canary."""
    if spec.statistic == "one_run":
        raise NotApplicable("the one-run statistic is implemented for gradient canaries (canaries: [gradient])")
    model, setting = _setup(cell, data, 1)
    X, y = data.X_train, data.y_train
    reference = reference_minimum(model, X, y)[0] if model.convex else None
    canary = canaries.input_canary(model, X, y, None if reference is None else np.atleast_2d(reference))
    scores, derived, guarantee = {}, {}, ""
    mirror = (canary.x, -canary.label) if algorithm.neighbouring() == "replace_one" else (np.zeros(data.d), 0.0)
    for world, (xc, yc), seeds in (("in", (canary.x, canary.label), range(0, trials)),
                                   ("out", mirror, range(trials, 2 * trials))):
        Xw, yw = np.vstack([X, xc[None, :]]), np.append(y, yc)
        parts = []
        for chunk in _chunks(seeds, spec.chunk):
            outcome, derived = _fit(algorithm, setting, model, Xw, yw, chunk)
            parts.append(canary.score(model, outcome.theta))
            guarantee = outcome.guarantee
        scores[world] = np.concatenate(parts)
    return Worlds({THREATS["input"][0]: (scores["in"], scores["out"])}, derived, guarantee)


def gradient_worlds(cell: Cell, spec: AuditSpec, algorithm: Algorithm, trials: int, data: Dataset) -> Worlds:
    """White box: a canary whose gradient is a fixed vector; both worlds are replicas of one fit (a mask).

    clopper_pearson: one canary, `trials` replicas with it and `trials` without. one_run: m = `spec.m_canaries`
    canaries in every one of `trials` runs, each included with probability 1/2 (its own coin per run); the bound
    is that of the first run (the others are printed for spread)."""
    m = spec.m_canaries if spec.statistic == "one_run" else 1
    model, setting = _setup(cell, data, m)
    X, y = data.X_train, data.y_train
    U = _directions(spec, model, X, y, m)
    markers, marker_y = canaries.marker_rows(m, data.d)
    Xw, yw = np.vstack([X, markers]), np.append(y, marker_y)
    clip = cell.clip_norm or 1.0
    raw_norm = spec.raw_norm if spec.raw_norm is not None else 2.0 * (data.n + 1) * max(clip, 1.0) + clip
    if spec.statistic == "one_run":
        included = np.random.default_rng(spec.seed).random((trials, m)) < 0.5
    else:
        included = np.zeros((2 * trials, 1), dtype=bool)
        included[:trials] = True
    # the canary's gradient per replica: +1 in, and out the null record (0) or, under replace-one, the mirror (−1)
    sign = np.where(included, 1.0, -1.0 if algorithm.neighbouring() == "replace_one" else 0.0)
    last, every, derived, guarantee = [], [], {}, ""
    for chunk in _chunks(range(0, included.shape[0]), spec.chunk):
        wrapped = canaries.with_gradient_canaries(model, U, sign[chunk.start:chunk.stop], raw_norm)
        outcome, derived = _fit(algorithm, setting, wrapped, Xw, yw, chunk)
        if not wrapped.projections:
            raise NotApplicable(f"{algorithm.name} does not train by clipped per-example gradients (no chain step "
                             "saw the canary); use canaries: [input]")
        s = canaries.gradient_scores(wrapped, outcome.theta, signed=algorithm.neighbouring() == "replace_one")
        last.append(s.last_iterate)
        every.append(s.all_iterates)
        guarantee = outcome.guarantee
    last, every = np.concatenate(last), np.concatenate(every)
    if spec.statistic == "one_run":  # the first run's canaries: in vs out
        pick = included[0]
        scores = {t: (s[0][pick], s[0][~pick]) for t, s in zip(THREATS["gradient"], (last, every))}
    else:
        scores = {t: (s[:trials, 0], s[trials:, 0]) for t, s in zip(THREATS["gradient"], (last, every))}
    return Worlds(scores, derived, guarantee)


def _directions(spec: AuditSpec, model: Model, X: np.ndarray, y: np.ndarray, m: int) -> np.ndarray:
    """(m, P) unit canary gradients: `unused` — the data's least-used input direction (logreg, m = 1), else
    random orthonormal (m ≤ P) or random unit vectors; `against_data` — against the data's gradient at θ₀."""
    P = model.n_params
    if spec.direction == "against_data":
        if m != 1:
            raise ValueError("direction: against_data takes one canary")
        theta0 = model.init([np.random.default_rng([spec.seed, 7])])
        return canaries.data_gradient_direction(model, theta0, X, y)[None, :]
    if m == 1 and P == X.shape[1]:
        return canaries.least_used_direction(X)[None, :]
    G = np.random.default_rng([spec.seed, 11]).standard_normal((m, P))
    if m <= P:
        return np.linalg.qr(G.T)[0].T
    return G / np.linalg.norm(G, axis=1, keepdims=True)
