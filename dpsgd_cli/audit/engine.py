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
           "delta", "epsilon_lo", "verdict", "reason", "covers", "ceiling", "trials_needed", "control",
           "control_epsilon", "control_epsilon_lo", "gdp_mu", "gdp_epsilon", "epsilon_rdp", "noiseless_fraction",
           "confidence", "family_size", "row_confidence", "statistic", "threshold", "auc", "tpr_at_fpr_1e-2",
           "tpr_at_fpr_1e-3", "trials", "canary", "threat_model", "neighbours", "batch_size", "lr", "epochs", "steps",
           "sigma", "guarantee", "scores_file", "wall_time", "status", "message"]
THREATS = {"input": ["black-box, last iterate"],
           "gradient": ["white-box, last iterate", "white-box, all iterates"],
           "dirac": ["white-box, last iterate", "white-box, all iterates"]}
# what a threat model's adversary sees: the released model only, or every iterate
SEES = {"black-box, last iterate": "final output", "white-box, last iterate": "final output",
        "white-box, all iterates": "every iterate"}
VERDICTS = ("refuted", "consistent", "uninformative", "not covered")


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
               algorithm: Optional[Algorithm] = None, data: Optional[Dataset] = None,
               scores: Optional[dict[str, np.ndarray]] = None) -> list[dict[str, Any]]:
    """Rows of audit.csv for one cell: one per threat model of each canary kind, each with its verdict.

    `confidence` is the family's: the k rows that can refute the cell's claim (the threat models it covers) are
    each bounded at 1 − α/k, so that all k hold together with probability `confidence` (Bonferroni). The same
    audit runs on the cell's broken twin (`spec.control`: its noise multiplied by that factor, the claim unchanged);
    a row is `consistent` only when it refutes the twin. `algorithm` and `data` replace the cell's (tests: a
    deliberately broken variant, a dataset built in the test); `scores`, when given, receives every row's raw
    scores (keys `<canary>.<threat>.<in|out>`, `control.` before them for the twin's)."""
    trials = trials or spec.trials
    confidence = confidence or spec.confidence
    algorithm = algorithm or cell.make_algorithm()
    data = data or dataset(cell.dataset)
    base = _base_row(cell, data, algorithm, trials, confidence, spec)
    twin = None
    if spec.control is not None and algorithm.private and algorithm.noise_scalable:
        twin = algorithm.with_noise_scale(spec.control)
    runs = []  # (kind, worlds or exception, twin's worlds or exception or None, seconds)
    for kind in spec.canaries:
        start = time.perf_counter()
        worlds = _worlds(kind, cell, spec, algorithm, trials, data)
        control = _worlds(kind, cell, spec, twin, trials, data) if twin is not None else None
        runs.append((kind, worlds, control, time.perf_counter() - start))
    covers = next((algorithm.covered(w.derived) for _, w, _, _ in runs if isinstance(w, Worlds)), algorithm.covers)
    family = sum(1 for _, w, _, _ in runs if isinstance(w, Worlds) for t in w.scores if _covered(covers, t))
    row_confidence = stats.family_confidence(confidence, family)
    rows = []
    for kind, worlds, control, elapsed in runs:
        if not isinstance(worlds, Worlds):
            status = "not applicable" if isinstance(worlds, NotApplicable) else "failed"
            rows += [{**base, "canary": kind, "threat_model": t, "status": status, "covers": covers,
                      "message": f"{type(worlds).__name__}: {worlds}".replace("\n", " ")} for t in THREATS[kind]]
            continue
        for threat, (s_in, s_out) in worlds.scores.items():
            row = {**base, **_derived_columns(worlds, cell, data), "canary": kind, "threat_model": threat,
                   "wall_time": elapsed, "covers": covers, "family_size": family, "row_confidence": row_confidence,
                   **_statistics(s_in, s_out, spec, row_confidence, worlds)}
            if scores is not None:
                scores[_key(kind, threat, "in")], scores[_key(kind, threat, "out")] = s_in, s_out
            row.update(_control_columns(control, threat, spec, row_confidence, scores, kind))
            row.update(_verdict(row, covers, threat))
            rows.append(row)
    return rows


def _key(kind: str, threat: str, world: str) -> str:
    return f"{kind}.{threat.replace(', ', '_').replace(' ', '_')}.{world}"


def _covered(covers: str, threat: str) -> bool:
    """Whether a claim covering `covers` is a claim about what the threat model's adversary sees."""
    return covers == "every iterate" or SEES[threat] == "final output"


def _worlds(kind: str, cell: Cell, spec: AuditSpec, algorithm: Algorithm, trials: int, data: Dataset):
    """The canary's worlds, or the exception that stopped them (recorded in the rows; the audit goes on)."""
    make = {"input": input_worlds, "gradient": gradient_worlds, "dirac": dirac_worlds}[kind]
    try:
        return make(cell, spec, algorithm, trials, data)
    except Exception as exc:
        return exc


def _control_columns(control, threat: str, spec: AuditSpec, confidence: float, scores: Optional[dict],
                     kind: str) -> dict[str, Any]:
    if control is None:
        return {}
    if not isinstance(control, Worlds) or threat not in control.scores:
        return {"control": spec.control, "control_epsilon": None, "control_epsilon_lo": None,
                "_control_failed": f"{type(control).__name__}: {control}".replace("\n", " ")}
    s_in, s_out = control.scores[threat]
    if scores is not None:
        scores["control." + _key(kind, threat, "in")], scores["control." + _key(kind, threat, "out")] = s_in, s_out
    stat = _statistics(s_in, s_out, spec, confidence, control)
    return {"control": spec.control, "control_epsilon": control.derived.get("epsilon_noise_scaled"),
            "control_epsilon_lo": stat.get("epsilon_lo")}


def _verdict(row: dict, covers: str, threat: str) -> dict[str, Any]:
    """refuted (ε_lo > ε, on a threat model the claim covers) · not covered (the claim says nothing about what
    this adversary sees) · consistent (ε_lo ≤ ε, and the same audit refuted the broken twin) · uninformative
    (ε_lo ≤ ε, and nothing shows that this audit could have seen a broken mechanism), each with its reason."""
    failed = row.pop("_control_failed", None)
    if row.get("status") != "ok" or row.get("epsilon_lo") is None:
        return {"verdict": None, "reason": ""}
    eps, lo = row["epsilon_claimed"], row["epsilon_lo"]
    if not _covered(covers, threat):
        return {"verdict": "not covered", "reason": f"the claim covers the {covers} only; this adversary sees "
                                                    f"every iterate (ε_lo = {lo:.3g}, no verdict on the claim)"}
    if lo > eps:
        return {"verdict": "refuted", "reason": f"ε_lo = {lo:.3g} > {eps:.3g} = ε"}
    if row.get("ceiling") is not None and row["ceiling"] <= eps:  # (the one-run statistic has no ceiling here)
        need = row.get("trials_needed")
        return {"verdict": "uninformative", "reason": f"ε = {eps:.3g} is above the ceiling {row['ceiling']:.3g} "
                f"of {row['trials']} trials: no mechanism could be refuted"
                + (f"; {need:,} trials per world would be needed" if need else "")}
    if "control" not in row:
        return {"verdict": "uninformative", "reason": f"no positive control ({row['algorithm']} has no noise-scale "
                                                      "hook, or the grid's audit.control is null)"}
    if failed:
        return {"verdict": "uninformative", "reason": f"positive control failed: {failed}"}
    c_lo, c_eps = row.get("control_epsilon_lo"), row.get("control_epsilon")
    if c_eps is not None and c_eps <= eps:
        return {"verdict": "uninformative", "reason": f"the twin (noise × {row['control']:g}) is not broken: its "
                                                      f"ε = {c_eps:.3g} ≤ {eps:.3g}"}
    if c_lo is not None and c_lo > eps:
        return {"verdict": "consistent", "reason": f"ε_lo = {lo:.3g} ≤ {eps:.3g}; the twin (noise × "
                                                   f"{row['control']:g}, ε = {_num(c_eps)}) refuted at {c_lo:.3g}"}
    return {"verdict": "uninformative", "reason": f"the twin (noise × {row['control']:g}, ε = {_num(c_eps)}) was "
                                                  f"not refuted either (ε_lo = {_num(c_lo)})"}


def _num(x) -> str:
    return "?" if x is None else f"{x:.3g}"


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
        top, need = None, None
    else:
        eps = stats.epsilon_clopper_pearson(s_in, s_out, confidence, delta, spec.threshold)
        top = stats.ceiling(s_in.size, s_out.size, confidence, delta, spec.threshold)
        claimed = worlds.derived.get("epsilon_achieved")
        need = (stats.trials_needed(claimed, confidence, delta, spec.threshold)
                if claimed is not None and np.isfinite(claimed) and top <= claimed else None)
    mu = stats.gdp_mu(s_in, s_out)
    return {"epsilon_lo": eps, "ceiling": top, "trials_needed": need, "gdp_mu": mu,
            "gdp_epsilon": stats.gdp_epsilon(mu, delta), "auc": stats.auc(s_in, s_out),
            "tpr_at_fpr_1e-2": stats.tpr_at_fpr(s_in, s_out, 1e-2),
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


def dirac_setup(cell: Cell, data: Dataset) -> tuple[Model, Setting, np.ndarray, np.ndarray, np.ndarray]:
    """(model, setting, U (1, P): the canary's direction e, X, y): the data with one more input coordinate, zero for
    every real record, and the marker row that carries the canary's gradient."""
    X = canaries.with_unused_input(data.X_train)
    model, setting = _setup(cell, dataclasses.replace(data, X_train=X), 1)
    setting = dataclasses.replace(setting, d=X.shape[1])
    U = np.zeros((1, model.n_params))
    U[0, canaries.dirac_index(model)] = 1.0
    markers, marker_y = canaries.marker_rows(1, X.shape[1])
    return model, setting, U, np.vstack([X, markers]), np.append(data.y_train, marker_y)


def dirac_worlds(cell: Cell, spec: AuditSpec, algorithm: Algorithm, trials: int, data: Dataset) -> Worlds:
    """White box, the Dirac canary: the data and the model get one more input coordinate, zero for every real
    record, and the canary's gradient is C·e on the parameter it feeds (`canaries.dirac_index`); `trials` replicas
    with it, `trials` without (the null record, or under replace-one the mirror −C·e), all of one fit. Scores: the
    last iterate's projection −⟨θ_T, e⟩, and over every iterate the per-step likelihood ratio of the canary's
    inclusions (`canaries.step_likelihood_ratio`, at the σ and sampling rate the mechanism declares)."""
    if spec.statistic == "one_run":
        raise NotApplicable("the one-run statistic is implemented for gradient canaries (canaries: [gradient])")
    model, setting, U, Xw, yw = dirac_setup(cell, data)
    clip = cell.clip_norm or 1.0
    raw_norm = spec.raw_norm if spec.raw_norm is not None else clip  # clipped or not, the sensitivity C
    mirror = algorithm.neighbouring() == "replace_one"
    sign = np.r_[np.ones(trials), np.full(trials, -1.0 if mirror else 0.0)][:, None]
    last, every, derived, guarantee = [], [], {}, ""
    for chunk in _chunks(range(0, 2 * trials), spec.chunk):
        wrapped = canaries.with_gradient_canaries(model, U, sign[chunk.start:chunk.stop], raw_norm)
        streams = ReplicaStreams(chunk)
        prepared = algorithm.prepare(setting, wrapped, Xw, yw, streams)
        if prepared is None:
            raise NotApplicable(f"{algorithm.name} does not train as a gradient chain here (no iterates to read)")
        outcome = prepared.train(wrapped)
        derived = {**outcome.derived, "_delta_audit": outcome.derived.get("delta_achieved", setting.delta)}
        if not wrapped.projections:
            raise NotApplicable(f"{algorithm.name} does not train by clipped per-example gradients (no chain step "
                                "saw the canary)")
        a = canaries.iterate_projections(wrapped, outcome.theta)
        norm = raw_norm if prepared.chain.clip is None else min(raw_norm, prepared.chain.clip)
        q = float(derived.get("sample_rate") or min(1.0, (setting.batch_size or setting.n) / setting.n))
        steps = canaries.step_model(prepared.chain, norm, q)
        x = canaries.step_statistics(a, steps)
        last.append(-a[-1])
        every.append(canaries.step_likelihood_ratio(x, steps.sigma, q, mirror=mirror))
        guarantee = outcome.guarantee
    last, every = np.concatenate(last), np.concatenate(every)
    scores = {t: (s[:trials], s[trials:]) for t, s in zip(THREATS["dirac"], (last, every))}
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
