"""Audit a grid: for every cell, train N replicas with the canary and N without (the worst-case neighbour of the
algorithm's claim), score them, bound ε from below (docs/audit.md#canaries-and-threat-models)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import scipy.stats

from dpsgd_cli import plugins
from dpsgd_cli.algorithms import Algorithm, Setting, backends
from dpsgd_cli.algorithms.erm import reference_minimum
from dpsgd_cli.algorithms.ops import Clip, LaplacianSmoothing, MaskedNoise, Noise, Op, Scale, Update, WeightDecay
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.audit import canaries, controls, stats
from dpsgd_cli.config import AuditSpec, Cell
from dpsgd_cli.data import Dataset
from dpsgd_cli.engine.checks import MAX_AUDIT_TRIALS
from dpsgd_cli.engine.runner import dataset, risk_columns, setting_of
from dpsgd_cli.models import Model, make_model
from dpsgd_cli.privacy import risk
from dpsgd_cli.privacy.risk import BOUND_COLUMNS

# statistic one_run: beside ε_lo (the f-DP test with the (ε, δ) curve, valid for any claim), Steinke et al.'s bound
# and the f-DP test with the μ-GDP curve (valid only for a Gaussian mechanism); never a verdict
ONE_RUN_BESIDE = ("epsilon_lo_steinke", "epsilon_lo_gdp")
COLUMNS = ["grid", "cell_id", "dataset", "model", "algorithm", "algorithm_params", "epsilon", "epsilon_claimed",
           "delta", "epsilon_lo", *ONE_RUN_BESIDE, "verdict", "reason", "detects", "covers", "ceiling",
           "trials_needed", "control", "control_epsilon", "control_epsilon_lo",
           *[f"control_{column}" for column in ONE_RUN_BESIDE], "control_row_confidence", "control_trials",
           *[f"{key}_{column}" for key in controls.LADDER
             for column in ("epsilon", "epsilon_lo", *ONE_RUN_BESIDE, "row_confidence", "trials")],
           "controls_not_applicable", "gdp_mu", "gdp_epsilon", "epsilon_rdp",
           "noiseless_fraction", "confidence", "family_size", "row_confidence", "statistic", "threshold", "auc",
           "tpr_at_fpr_1e-2", "tpr_bound_fpr_1e-2", "tpr_at_fpr_1e-3", "tpr_bound_fpr_1e-3", "trials", "canary",
           "threat_model", "neighbours", "batch_size", "lr",
           "epochs", "steps", "sigma", "guarantee", "scores_file", "wall_time", "status", "message", "plugin",
           "plugin_sha256"]
THREATS = {"input": ["black-box, last iterate"],
           "gradient": ["white-box, last iterate", "white-box, all iterates"],
           "dirac": ["white-box, last iterate", "white-box, all iterates"]}
# what a threat model's adversary sees: the released model only, or every iterate
SEES = {"black-box, last iterate": "final output", "white-box, last iterate": "final output",
        "white-box, all iterates": "every iterate"}
VERDICTS = ("refuted", "consistent", "uninformative", "not covered")
# one-run statistics need canaries that do not interfere: each its own coordinate (docs/audit.md)
ONE_RUN_REFUSAL = ("statistic: one_run needs canaries: [dirac] (one unused input coordinate per canary, pooled "
                   "over the trials); input and gradient canaries share the data's coordinates")


@dataclasses.dataclass
class Worlds:
    """Scores of the trials with the canary and without, per threat model, and what the runs derived."""

    scores: dict[str, tuple[np.ndarray, np.ndarray]]
    derived: dict[str, Any]
    guarantee: str
    setting: Setting | None = None  # the setting the worlds trained in (the canary rows included)


class NotApplicable(ValueError):
    """This canary cannot be planted in this algorithm (the row says so; not a failure)."""


def audit_cell(cell: Cell, spec: AuditSpec, trials: int | None = None, confidence: float | None = None,
               algorithm: Algorithm | None = None, data: Dataset | None = None,
               scores: dict[str, np.ndarray] | None = None) -> list[dict[str, Any]]:
    """Rows of audit.csv for one cell: one per threat model of each canary kind, each with its verdict (the
    family's `confidence`, the broken twin: docs/audit.md). `algorithm` and `data` replace the cell's; `scores`
    receives every row's raw scores (keys `<canary>.<threat>.<in|out>`, `control.` before them for the twin's)."""
    confidence = confidence or spec.confidence
    algorithm = algorithm or cell.make_algorithm()
    data = data or dataset(cell.dataset, cell.validation)  # the rows the run trained on: its n and δ
    ladder = controls.ladder(cell, data, algorithm, spec.control, spec.ladder)
    ran = [c for c in ladder if c.algorithm is not None]
    trials = trials or spec.trials
    plan = (TrialsPlan(trials, None, None, 0.0) if trials
            else plan_trials(cell, spec, None, confidence, algorithm, data, ladder))
    base = _base_row(cell, data, algorithm, plan.trials, confidence, spec)
    x_norm = 1.0 if controls.clipping_bounds_the_claim(cell, data, algorithm) else controls.CLIP_PROBE * _clip(cell)
    runs = []  # (kind, worlds or exception, {control key: its worlds or exception}, seconds)
    for kind in spec.canaries:
        start = time.perf_counter()
        worlds = _worlds(kind, cell, spec, algorithm, plan.of("cell", kind), data, x_norm)
        mutated = {c.key: _worlds(kind, cell, spec, c.algorithm, plan.of(c.key, kind), data, x_norm)
                   for c in ran if c.algorithm is not None}
        runs.append((kind, worlds, mutated, time.perf_counter() - start))
    covers = next((algorithm.covered(w.derived) for _, w, _, _ in runs if isinstance(w, Worlds)), algorithm.tags.covers)
    family = _distinct_tests([w for _, w, _, _ in runs if isinstance(w, Worlds)], covers)
    row_confidence = stats.family_confidence(confidence, family)
    # each control's rows bounded at the level of its own family
    levels = {c.key: stats.family_confidence(confidence, _distinct_tests(
        [m[c.key] for _, _, m, _ in runs if isinstance(m[c.key], Worlds)], covers)) for c in ran}
    not_applicable = "; ".join(f"{c.label}: {c.why_not}" for c in ladder if c.algorithm is None)
    rows = []
    for kind, worlds, mutated, elapsed in runs:
        if not isinstance(worlds, Worlds):
            status = "not applicable" if isinstance(worlds, NotApplicable) else "failed"
            rows += [{**base, "canary": kind, "threat_model": t, "status": status, "covers": covers,
                      "message": (str(worlds) if status == "not applicable"  # the reason, not the class name
                                  else f"{type(worlds).__name__}: {worlds}").replace("\n", " ")}
                     for t in THREATS[kind]]
            continue
        derived = {**_derived_columns(worlds, cell, data), **_tpr_bounds(algorithm, worlds)}
        for threat, (s_in, s_out) in worlds.scores.items():
            row = {**base, **derived, "canary": kind, "threat_model": threat, "trials": plan.of("cell", kind),
                   "wall_time": elapsed, "covers": covers, "family_size": family, "row_confidence": row_confidence,
                   **_statistics(s_in, s_out, spec, row_confidence, worlds, derived["epsilon_claimed"]),
                   "controls_not_applicable": not_applicable}
            if scores is not None:
                scores[_key(kind, threat, "in")], scores[_key(kind, threat, "out")] = s_in, s_out
            if any(c.key == "control" for c in ran):
                row["control"] = spec.control
            for control in ran:
                row.update(_control_columns(control, mutated[control.key], threat, spec, levels[control.key],
                                            scores, kind, derived["epsilon_claimed"]))
            row.update(_verdict(row, covers, threat))
            rows.append(row)
    return rows


def _clip(cell: Cell) -> float:
    return cell.clip_norm or 1.0


def _distinct_tests(worlds: list[Worlds], covers: str) -> int:
    """How many different tests the covered rows are: rows whose scores order the trials identically give the
    same bound under every rule here and count once (the union bound holds with the distinct tests alone)."""
    seen = set()
    for w in worlds:
        for threat, (s_in, s_out) in w.scores.items():
            if not _covered(covers, threat):
                continue
            both = np.concatenate([s_in, s_out])
            ranks = scipy.stats.rankdata(both, method="min") if np.isfinite(both).all() else both
            seen.add((s_in.size, np.asarray(ranks).tobytes()))
    return len(seen)


def _key(kind: str, threat: str, world: str) -> str:
    return f"{kind}.{threat.replace(', ', '_').replace(' ', '_')}.{world}"


def _covered(covers: str, threat: str) -> bool:
    """Whether a claim covering `covers` is a claim about what the threat model's adversary sees."""
    return covers == "every iterate" or SEES[threat] == "final output"


def _worlds(kind: str, cell: Cell, spec: AuditSpec, algorithm: Algorithm, trials: int, data: Dataset,
            x_norm: float = 1.0):
    """The canary's worlds, or the exception that stopped them (recorded in the rows; the audit goes on);
    `x_norm`: the input canary's norm."""
    try:
        if kind == "input":
            return input_worlds(cell, spec, algorithm, trials, data, x_norm)
        return {"gradient": gradient_worlds, "dirac": dirac_worlds}[kind](cell, spec, algorithm, trials, data)
    except Exception as exc:
        return exc


def _control_columns(control: controls.Control, worlds, threat: str, spec: AuditSpec, confidence: float,
                     scores: dict | None, kind: str, claim: float) -> dict[str, Any]:
    """A control's columns for this row: its true ε, its bound at `confidence` (the level of its own family; the
    same rule, the same claim) and that level."""
    key = control.key
    if not isinstance(worlds, Worlds) or threat not in worlds.scores:
        return {f"{key}_epsilon": None, f"{key}_epsilon_lo": None,
                f"_{key}_failed": f"{type(worlds).__name__}: {worlds}".replace("\n", " ")}
    s_in, s_out = worlds.scores[threat]
    if scores is not None:
        scores[f"{key}." + _key(kind, threat, "in")], scores[f"{key}." + _key(kind, threat, "out")] = s_in, s_out
    stat = _statistics(s_in, s_out, spec, confidence, worlds, claim)
    return {f"{key}_epsilon": control.epsilon(worlds.derived), f"{key}_epsilon_lo": stat.get("epsilon_lo"),
            **{f"{key}_{column}": stat.get(column) for column in ONE_RUN_BESIDE}, f"{key}_row_confidence": confidence,
            f"{key}_trials": s_in.size}


def _verdict(row: dict, covers: str, threat: str) -> dict[str, Any]:
    """The row's verdict (one of VERDICTS, docs/audit.md) with its reason, and the mildest control it refuted
    (`detects`)."""
    failed = row.pop("_control_failed", None)
    broken = [f"{key}: {row.pop(f'_{key}_failed')}" for key in controls.LADDER if f"_{key}_failed" in row]
    if broken:
        row["message"] = "; ".join([row.get("message") or "", "control failed: " + "; ".join(broken)]).lstrip("; ")
    if row.get("status") != "ok" or row.get("epsilon_lo") is None:
        return {"verdict": None, "reason": "", "detects": None}
    eps, lo = row["epsilon_claimed"], row["epsilon_lo"]
    if not _covered(covers, threat):
        return {"verdict": "not covered", "detects": None,
                "reason": f"the claim covers the {covers} only; this adversary sees every iterate (ε_lo = {lo:.3g}, "
                          "no verdict on the claim)"}
    caught = [o for o in controls.outcomes([row]) if o.caught]
    detects = {"detects": caught[0].label if caught else None}
    if lo > eps:
        return {"verdict": "refuted", "reason": f"ε_lo = {lo:.3g} > {eps:.3g} = ε", **detects}
    if row.get("ceiling") is not None and row["ceiling"] <= eps:  # (the one-run statistic has no ceiling here)
        need = row.get("trials_needed")
        return {"verdict": "uninformative", "reason": f"ε = {eps:.3g} is above the ceiling {row['ceiling']:.3g} "
                f"of {row['trials']} trials: no mechanism could be refuted"
                + (f"; {need:,} trials per world would be needed" if need else ""), **detects}
    if "control" not in row:
        return {"verdict": "uninformative", "reason": f"no positive control ({row['algorithm']} has no noise-scale "
                                                      "hook, or the grid's audit.control is null)", **detects}
    if failed:
        return {"verdict": "uninformative", "reason": f"positive control failed: {failed}", **detects}
    c_lo, c_eps = row.get("control_epsilon_lo"), row.get("control_epsilon")
    if c_eps is not None and c_eps <= eps:
        return {"verdict": "uninformative", "reason": f"the twin (noise × {row['control']:g}) is not broken: its "
                                                      f"ε = {c_eps:.3g} ≤ {eps:.3g}", **detects}
    if c_lo is not None and c_lo > eps:
        return {"verdict": "consistent", "reason": f"ε_lo = {lo:.3g} ≤ {eps:.3g}; {controls.caught_and_missed([row])}",
                **detects}
    return {"verdict": "uninformative", "reason": f"the twin (noise × {row['control']:g}, ε = {_num(c_eps)}) was "
                                                  f"not refuted either (ε_lo = {_num(c_lo)})", **detects}


def _num(x) -> str:
    return "?" if x is None else f"{x:.3g}"


def _base_row(cell: Cell, data: Dataset, algorithm: Algorithm, trials: int, confidence: float, spec: AuditSpec) -> dict:
    return {"grid": cell.grid, "cell_id": cell.cell_id, "dataset": data.name, "model": cell.model.name,
            "algorithm": algorithm.name, "algorithm_params": json.dumps(cell.algorithm.params, sort_keys=True),
            "epsilon": cell.epsilon, "trials": trials, "confidence": confidence, "statistic": spec.statistic,
            "neighbours": algorithm.neighbouring(),
            "threshold": spec.threshold if spec.statistic == "clopper_pearson" else "bonferroni",
            "batch_size": cell.batch_size, "lr": cell.lr, "epochs": cell.epochs, "status": "ok", "message": "",
            **plugins.provenance(algorithm.name)}


def _derived_columns(worlds: Worlds, cell: Cell, data: Dataset) -> dict[str, Any]:
    d = worlds.derived
    claimed = d.get("epsilon_achieved")
    claimed = cell.epsilon if claimed is None else claimed  # a calibration that proves nothing: the target ε
    delta = d.get("delta_achieved", setting_of(cell, data).delta)  # song2013 (basic composition): pure, δ = 0
    return {"epsilon_claimed": claimed, "delta": delta, "steps": d.get("steps"), "sigma": d.get("sigma"),
            "epsilon_rdp": d.get("epsilon_rdp"),  # bassily2014: what RDP certifies for the σ used
            "noiseless_fraction": d.get("noiseless_fraction_mean"),  # pidp_sgd: steps that skipped the noise
            "guarantee": worlds.guarantee}


def _tpr_bounds(algorithm: Algorithm, worlds: Worlds) -> dict[str, Any]:
    """The accountant's bound on any test's TPR at each FPR for the mechanism audited (`runner.risk_columns`), beside
    the audit's measured TPR at the same FPR."""
    if not algorithm.tags.private or worlds.setting is None:
        return {}
    risk = risk_columns(algorithm, worlds.setting, worlds.guarantee, worlds.derived,
                        worlds.derived.get("epsilon_achieved"))
    return {column: risk[column] for column in BOUND_COLUMNS.values()}


def _statistics(s_in: np.ndarray, s_out: np.ndarray, spec: AuditSpec, confidence: float, worlds: Worlds,
                claim: float) -> dict:
    """The row's numbers; `claim` fixes the rule "order"'s ranks before any score is seen."""
    delta = worlds.derived.get("_delta_audit", 0.0)
    finite = np.isfinite(s_in).all() and np.isfinite(s_out).all()
    if not finite:
        keep_in, keep_out = s_in[np.isfinite(s_in)], s_out[np.isfinite(s_out)]
        return {"status": "diverged", "message": f"{s_in.size - keep_in.size + s_out.size - keep_out.size} "
                "replicas diverged (non-finite scores); no bound", "epsilon_lo": None}
    beside: dict[str, float | None] = {}
    if spec.statistic == "one_run":  # one test decides (docs/audit.md: why no correction for the columns beside it)
        eps = stats.epsilon_one_run_fdp(s_in, s_out, confidence, delta, curve="dp")
        beside = {"epsilon_lo_steinke": stats.epsilon_one_run(s_in, s_out, confidence, delta),
                  "epsilon_lo_gdp": stats.epsilon_one_run_fdp(s_in, s_out, confidence, delta, curve="gdp")
                  if delta > 0 else None}  # no μ-GDP curve is pure DP
        top, need = None, None
    else:
        eps = stats.epsilon_clopper_pearson(s_in, s_out, confidence, delta, spec.threshold, claim=claim)
        top = stats.ceiling(s_in.size, s_out.size, confidence, delta, spec.threshold, claim)
        need = (stats.trials_needed(claim, confidence, delta, spec.threshold)
                if claim is not None and np.isfinite(claim) and top <= claim else None)
    mu = stats.gdp_mu(s_in, s_out)
    return {"epsilon_lo": eps, **beside, "ceiling": top, "trials_needed": need, "gdp_mu": mu,
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


def input_worlds(cell: Cell, spec: AuditSpec, algorithm: Algorithm, trials: int, data: Dataset,
                 x_norm: float = 1.0) -> Worlds:
    """Black box: D ∪ {(x_c, y_c)} against D ∪ {(0, 0)} (add/remove) or D ∪ {(x_c, −y_c)} (replace-one), ‖x_c‖ =
    `x_norm`; score = the released model's margin on the canary."""
    if spec.statistic == "one_run":
        raise NotApplicable(ONE_RUN_REFUSAL)
    model, setting = _setup(cell, data, 1)
    X, y = data.X_train, data.y_train
    reference = reference_minimum(model, X, y)[0] if model.convex else None
    canary = canaries.input_canary(model, X, y, None if reference is None else np.atleast_2d(reference), x_norm)
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
    return Worlds({THREATS["input"][0]: (scores["in"], scores["out"])}, derived, guarantee, setting)


def gradient_worlds(cell: Cell, spec: AuditSpec, algorithm: Algorithm, trials: int, data: Dataset) -> Worlds:
    """White box: a canary whose gradient is a fixed vector u; `trials` replicas with it and `trials` without,
    both worlds replicas of one fit (a mask)."""
    if spec.statistic == "one_run":
        raise NotApplicable(ONE_RUN_REFUSAL)
    model, setting = _setup(cell, data, 1)
    X, y = data.X_train, data.y_train
    U = _directions(spec, model, X, y)
    markers, marker_y = canaries.marker_rows(1, data.d)
    Xw, yw = np.vstack([X, markers]), np.append(y, marker_y)
    clip = cell.clip_norm or 1.0
    raw_norm = spec.raw_norm if spec.raw_norm is not None else 2.0 * (data.n + 1) * max(clip, 1.0) + clip
    # the canary's gradient per replica: +1 in, and out the null record (0) or, under replace-one, the mirror (−1)
    sign = np.r_[np.ones(trials), np.full(trials, -1.0 if algorithm.neighbouring() == "replace_one" else 0.0)]
    sign = sign[:, None]
    last, every, derived, guarantee = [], [], {}, ""
    for chunk in _chunks(range(0, 2 * trials), spec.chunk):
        wrapped = canaries.with_gradient_canaries(model, U, sign[chunk.start:chunk.stop], raw_norm)
        outcome, derived = _fit(algorithm, setting, wrapped, Xw, yw, chunk)
        if not wrapped.projections:
            raise NotApplicable(f"{algorithm.name} does not train by clipped per-example gradients (no chain step "
                                "saw the canary); use canaries: [input]")
        s = canaries.gradient_scores(wrapped, outcome.theta, signed=algorithm.neighbouring() == "replace_one")
        last.append(s.last_iterate)
        every.append(s.all_iterates)
        guarantee = outcome.guarantee
    stacked = np.concatenate(last), np.concatenate(every)
    scores = {t: (s[:trials, 0], s[trials:, 0]) for t, s in zip(THREATS["gradient"], stacked)}
    return Worlds(scores, derived, guarantee, setting)


def dirac_setup(cell: Cell, data: Dataset, m: int = 1,
                watch: int = 0) -> tuple[Model, Setting, np.ndarray, np.ndarray, np.ndarray]:
    """(model, setting, U (m + watch, P), X, y): the data with m more input coordinates, zero for every real
    record, and m marker rows that carry the canaries' gradients along U's first m rows; the `watch` rows after
    them are zero, for directions the caller wants recorded that no marker row feeds."""
    X = np.hstack([data.X_train, np.zeros((data.X_train.shape[0], m), dtype=data.X_train.dtype)])
    model, setting = _setup(cell, dataclasses.replace(data, X_train=X), m)
    setting = dataclasses.replace(setting, d=X.shape[1])
    U = np.zeros((m + watch, model.n_params))
    # the last input feeds parameter dirac_index alone, and input k parameter k (logistic regression's weights,
    # the MLP's first hidden unit's row of W1): the last m inputs feed the m parameters before it
    U[np.arange(m), canaries.dirac_index(model) - m + 1 + np.arange(m)] = 1.0
    markers, marker_y = canaries.marker_rows(m + watch, X.shape[1])
    return model, setting, U, np.vstack([X, markers[:m]]), np.append(data.y_train, marker_y[:m])


def dirac_worlds(cell: Cell, spec: AuditSpec, algorithm: Algorithm, trials: int, data: Dataset) -> Worlds:
    """White box, the Dirac canary (docs/audit.md): scores −⟨θ_T, w⟩ (Mᵀw = e, `_post_processing`) and the
    per-step likelihood ratio over every iterate; with `statistic: one_run` (Steinke, Nasr, Jagielski 2023),
    `m_canaries` per training, each included with probability 1/2, pooled over the trainings."""
    one_run = spec.statistic == "one_run"
    m = spec.m_canaries if one_run else 1
    mirror = algorithm.neighbouring() == "replace_one"
    model, setting, U, Xw, yw = dirac_setup(cell, data, m)
    Mt = _post_processing(algorithm, setting, model, Xw, yw)
    scale = np.ones(m)
    if Mt is not None:  # record ⟨θ_t, w_k⟩ as well, through the unit directions w_k/‖w_k‖ (no marker feeds them)
        model, setting, U, Xw, yw = dirac_setup(cell, data, m, watch=m)
        W = np.linalg.solve(Mt, U[:m].T).T  # Mᵀ w_k = e_k
        scale = np.linalg.norm(W, axis=1)
        U[m:] = W / scale[:, None]
    # a sound chain clips it to C; one that does not clip lets it through CLIP_PROBE times larger
    raw_norm = spec.raw_norm if spec.raw_norm is not None else controls.CLIP_PROBE * _clip(cell)
    if one_run:
        included = np.random.default_rng(spec.seed).random((trials, m)) < 0.5
    else:
        included = np.r_[np.ones(trials, dtype=bool), np.zeros(trials, dtype=bool)][:, None]
    weight = np.where(included, 1.0, -1.0 if mirror else 0.0)
    weight = np.hstack([weight, np.zeros((weight.shape[0], U.shape[0] - m))])
    last, every, derived, guarantee = [], [], {}, ""
    for chunk in _chunks(range(0, weight.shape[0]), spec.chunk):
        wrapped = canaries.with_gradient_canaries(model, U, weight[chunk.start:chunk.stop], raw_norm)
        prepared = algorithm.prepare(setting, wrapped, Xw, yw, ReplicaStreams(chunk))
        if prepared is None:
            raise NotApplicable(f"{algorithm.name} does not train as a gradient chain here (no iterates to read)")
        outcome = prepared.train(wrapped)
        derived = {**outcome.derived, "_delta_audit": outcome.derived.get("delta_achieved", setting.delta)}
        if not wrapped.projections:
            raise NotApplicable(f"{algorithm.name} does not train by clipped per-example gradients (no chain step "
                                "saw the canary)")
        blocks = [*wrapped.projections, outcome.theta @ U.T]
        proj = np.concatenate([np.reshape(b, (-1, *b.shape[-2:])) for b in blocks])  # (T + 1, R, m [+ m])
        a = proj[:, :, :m]
        v = proj[:, :, m:] * scale if Mt is not None else a
        norm = raw_norm if prepared.chain.clip is None else min(raw_norm, prepared.chain.clip)
        q = float(derived.get("sample_rate") or min(1.0, (setting.batch_size or setting.n) / setting.n))
        steps = canaries.step_model(prepared.chain, norm, q)
        x = _step_statistics(a, v, steps)  # (T, R, m)
        last.append(-v[-1])
        every.append(canaries.step_likelihood_ratio(x.reshape(x.shape[0], -1), steps.sigma, q,
                                                    mirror=mirror).reshape(x.shape[1:]))
        guarantee = outcome.guarantee
    stacked = np.concatenate(last), np.concatenate(every)
    scores = {t: (s[included], s[~included]) for t, s in zip(THREATS["dirac"], stacked)}
    return Worlds(scores, derived, guarantee, setting)


def _step_statistics(a: np.ndarray, v: np.ndarray, steps: canaries.StepModel) -> np.ndarray:
    """x_t = −((v_{t+1} − v_t)/η_t + λ a_t)/(F c) = b_t + σ z_t (T, ...): `canaries.step_statistics` with the
    update read along w (v_t = ⟨θ_t, w⟩) and the weight decay along e (a_t = ⟨θ_t, e⟩); v = a without M."""
    eta = np.array([steps.schedule(t) for t in range(1, a.shape[0])]).reshape(-1, *([1] * (a.ndim - 1)))
    return -(np.diff(v, axis=0) / eta + steps.lam * a[:-1]) / (steps.F * steps.c)


def _post_processing(algorithm: Algorithm, setting: Setting, model: Model, X: np.ndarray,
                     y: np.ndarray) -> np.ndarray | None:
    """Mᵀ (P, P) of the fixed linear map a chain applies to its noisy gradient after the noise (dp_lssgd's A⁻¹),
    read off the identity; None when there is none, or it is not linear (then e alone: valid, only weaker)."""
    prepared = algorithm.prepare(setting, model, X, y, ReplicaStreams(range(1)))
    if prepared is None:
        return None
    tail: list[Op] = []
    for op in prepared.chain.ops:
        if isinstance(op, Update):
            break
        tail = [] if isinstance(op, (Noise, MaskedNoise, Scale, WeightDecay, Clip)) else [*tail, op]
    tail = [op for op in tail if not (isinstance(op, LaplacianSmoothing) and op.sigma_ls == 0)]
    if not tail:
        return None
    P = model.n_params

    def apply(g: np.ndarray, theta: np.ndarray) -> np.ndarray:
        for op in tail:
            g, _ = op.update(g, op.init(theta), theta)
        return np.asarray(g, dtype=float)

    Mt = apply(np.eye(P), np.zeros((P, P)))  # row i: (M e_i)ᵀ
    rng = np.random.default_rng([P, 5])
    G = rng.standard_normal((3, P))
    if not np.allclose(apply(G, rng.standard_normal((3, P))), G @ Mt, rtol=1e-8, atol=1e-10):
        return None
    if np.linalg.cond(Mt) > 1e8:
        return None
    return Mt


def _directions(spec: AuditSpec, model: Model, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(1, P): the canary's unit gradient: `unused` — the data's least-used input direction (logreg), or a
    random one (the MLP); `against_data` — against the data's gradient at θ₀."""
    P = model.n_params
    if spec.direction == "against_data":
        theta0 = model.init([np.random.default_rng([spec.seed, 7])])
        return canaries.data_gradient_direction(model, theta0, X, y)[None, :]
    if X.shape[1] == P:
        return canaries.least_used_direction(X)[None, :]
    g = np.random.default_rng([spec.seed, 11]).standard_normal(P)
    return (g / np.linalg.norm(g))[None, :]


# --- how many trials ------------------------------------------------------------------------------------------------

HALF_NOISE = 0.5  # the control the default trials are chosen to refute: the cell's noise halved
MARGIN = 3  # trials per what an optimal attack needs at its expected counts: draws vary, canaries fall short of it
MIN_TRIALS = 100
# a cell whose noise × 0.5 control's trials cost at most REACH × the budget gets them; the budget binds the cells
# farther from it (on the `audit` grid 3.1 to 27 budgets), which would cost the grid most of its time
REACH = 3
# the least the twin and no clipping get (the verdict and `would have caught` rest on them): their needs are an
# optimal attack's, which a canary on a projected chain falls far short of (song2013's twin, ε = 10 against 1, is
# not refuted at 100 trials); 500 refuted every twin of the `audit` grid that any trial count refuted
CONTROL_MIN_TRIALS = 500
ONE_RUN_TRIALS = 500  # statistic one_run: trainings pooled, each with m_canaries canaries
PILOT_REPLICAS = 32  # an algorithm trained by `fit` alone derives its values (ε, the controls' ε) on this many
# One replica's training, in CPU seconds (measured: Dirac canary, dp_sgd, B = 64, on synthetic d = 5 and adult d =
# 104): a fixed part (its random streams, from the seeds, and sampler; compiled, tens of µs) and per step, by where
# the chain runs (compiled or NumPy), a part per step (the Poisson sampler's gaps included) and one per example and
# parameter.
REPLICA_SECONDS = 2e-5
STEP_SECONDS = {True: 2.5e-6, False: 1.4e-5}
EXAMPLE_PARAMETER_SECONDS = {True: 5e-10, False: 3e-9}
# One replica of an algorithm trained by `fit` alone, estimated from the work its fit reports (never timed: the plan,
# and so ε_lo and the verdict, would follow the machine's load): a fixed part (measured: output_perturbation, logreg
# d = 5, chunks of 1,000, 3.4 to 4.3e-5 s: its streams, noise and score), a chain run inside the fit as the steps
# above (compiled where it ran compiled; bassily2014's single-example kernel takes ~5× less), and an L-BFGS solve
# per call to `fit` (one per chunk at most), per iteration a fixed part and one per example and parameter
# (measured, one start, from cold: n × P = 300 × 5 to 20,000 × 20, 4 to 16 ms).
FIT_REPLICA_SECONDS = 4e-5
LBFGS_ITERATION_SECONDS = 8e-4
LBFGS_EXAMPLE_PARAMETER_SECONDS = 5e-9


@dataclasses.dataclass(frozen=True)
class TrialsPlan:
    """A cell's trials per world, per variant (the cell, its twin, each control of its ladder) and canary kind, what
    refuting the noise × 0.5 control needs, and the training time they take."""

    trials: int  # the cell's own (its white-box rows', and the noise × 0.5 control's beside them)
    needed: int | None  # MARGIN × an optimal attack's trials to refute the control (None: none, or beyond the limit)
    control_epsilon: float | None  # the true ε of the cell with its noise halved (its accountant's)
    seconds_per_trial: float  # estimated: every canary kind, both worlds, the cell and each control at as many
    table: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # variant → canary kind → trials
    needs: dict[str, int | None] = dataclasses.field(default_factory=dict)  # control key → what refuting it takes
    kind_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # canary kind → seconds per trial

    @property
    def seconds(self) -> float:
        if not self.table:
            return self.trials * self.seconds_per_trial
        return sum(n * self.kind_seconds[kind] for by_kind in self.table.values() for kind, n in by_kind.items())

    def of(self, key: str, kind: str) -> int:
        """The trials per world of a variant ("cell" or a control's key) with the canary `kind`."""
        return self.table.get(key, {}).get(kind, self.trials)


def plan_trials(cell: Cell, spec: AuditSpec, trials: int | None = None, confidence: float | None = None,
                algorithm: Algorithm | None = None, data: Dataset | None = None,
                ladder: list[controls.Control] | None = None) -> TrialsPlan:
    """The trials per world of the cell and of each of its controls: `trials` or the grid's for all of them; else
    per variant what refuting it takes: MARGIN × the trials at which the optimal attack on that mechanism refutes
    the claimed ε at its expected counts (its TPR at each FPR the accountant's bound from its privacy profile, the
    rule "order", the row confidence of a family of every covered row). The cell gets what refuting the noise ×
    0.5 control takes (so it is audited as strongly as that control), a control what refuting it takes (the twin
    and no clipping at least CONTROL_MIN_TRIALS); a control out of reach at the cell's trials gets MIN_TRIALS (the
    twin the cell's: the verdict rests on it). Beside a white-box Dirac canary, the black-box input canary's rows
    of every variant take what the twin and no clipping take. The cell's trials are the most within `spec.budget`
    seconds of estimated training (REACH × `spec.budget` where that affords what refuting the noise × 0.5 control
    takes) and MAX_AUDIT_TRIALS, at least MIN_TRIALS (docs/audit.md)."""
    confidence = confidence or spec.confidence
    algorithm = algorithm or cell.make_algorithm()
    data = data or dataset(cell.dataset, cell.validation)
    model, setting = _setup(cell, data, 1)
    X = np.vstack([data.X_train, np.zeros((1, data.d), dtype=data.X_train.dtype)])  # the null record
    y = np.append(data.y_train, 0.0)
    if ladder is None:  # audit_cell passes the ladder it built (its T/10 control is a calibration)
        ladder = controls.ladder(cell, data, algorithm, spec.control, spec.ladder)
    ladder = [c for c in ladder if c.algorithm is not None]
    half = algorithm.with_noise_scale(HALF_NOISE) if algorithm.tags.noise_scalable else algorithm
    prepared = half.prepare(setting, model, X, y, ReplicaStreams(range(1)))
    if prepared is None:  # trained by `fit` alone: its cost from the work its pilot fit reports, not its time
        derived = _fit(half, setting, model, X, y, range(min(spec.chunk, PILOT_REPLICAS)))[1]
        seconds = _fit_seconds(derived, setting, model, spec.chunk)
        per_replica = {kind: seconds if kind == "input" else 0.0 for kind in spec.canaries}
    else:
        derived = prepared.finish(prepared.theta).derived
        per_replica = {kind: _replica_seconds(prepared, model if kind == "input" else _canary_model(model))
                       for kind in spec.canaries}
    one_run = spec.statistic == "one_run"  # a trial is one training holding m canaries, not a pair of worlds
    seconds_per_trial = (1 if one_run else 2) * sum(per_replica.values())
    achieved = derived.get("epsilon_achieved")  # as the rows' epsilon_claimed
    claim = float(achieved) if achieved is not None else float(cell.epsilon or 0.0)
    delta = derived.get("delta_achieved", setting.delta)
    rows = sum(_covered(algorithm.tags.covers, t) for kind in spec.canaries for t in THREATS[kind])
    level = stats.family_confidence(confidence, rows)

    def need(mechanism: Algorithm, epsilon: float | None, derived: dict[str, Any]) -> int | None:
        if epsilon is None or not epsilon > claim or not np.isfinite(claim) or one_run:
            return None
        optimal = stats.trials_to_refute(_power(mechanism, setting, derived, epsilon, delta), claim, level, delta,
                                         limit=MAX_AUDIT_TRIALS)
        return MARGIN * optimal if optimal is not None else None

    control = derived.get("epsilon_noise_scaled") if half is not algorithm else None
    needed = need(half, control, derived)
    trials = trials if trials is not None else spec.trials
    if trials is not None or one_run:
        trials = trials if trials is not None else ONE_RUN_TRIALS
        return TrialsPlan(trials, needed, control, (1 + len(ladder)) * seconds_per_trial)
    needs = {c.key: needed if c.key == "noise_half" else _control_need(c, algorithm, setting, model, X, y, need)
             for c in ladder}
    wanted = min(needed or MAX_AUDIT_TRIALS, MAX_AUDIT_TRIALS)
    kind_seconds: dict[str, float] = {kind: 2 * t for kind, t in per_replica.items()}
    # at the cell's trials: the cell, the noise × 0.5 control beside it, and the twin where nothing says it needs fewer
    at_cell = {"cell", "noise_half"} | ({"control"} if needs.get("control", 0) is None else set())
    # the black-box input canary adds little against noise × 0.5 where a white-box Dirac canary sees every step:
    # there the input rows of every variant take what the twin and no clipping need, the Dirac rows the plan's
    white = "input" in per_replica and per_replica.get("dirac", 0.0) > 0

    def table(trials: int, within: set[str]) -> dict[str, dict[str, int]]:
        each = {key: max(CONTROL_MIN_TRIALS if key in ("control", "no_clip") else MIN_TRIALS, needs[key] or 0)
                if key in within  # what refuting it takes
                else trials if key in at_cell or key == "control"  # the twin: the verdict rests on it
                else MIN_TRIALS  # out of reach: it cannot be refuted at its expected counts with the trials affordable
                for key in ["cell", *needs]}
        black = max([MIN_TRIALS, *(each[key] for key in ("control", "no_clip") if key in each and key not in at_cell)])
        return {key: {kind: min(n, black) if white and kind == "input" else n for kind in per_replica}
                for key, n in each.items()}

    def cost(plan: dict[str, dict[str, int]]) -> float:
        return sum(n * kind_seconds[kind] for by_kind in plan.values() for kind, n in by_kind.items())

    # the controls within reach of the cell's trials take what refuting them takes, the rest MIN_TRIALS: the most
    # (cheapest first) whose needs are within the trials the budget leaves the cell beside them
    others = sorted((n, key) for key, n in needs.items() if key not in at_cell and n is not None)
    # a cell whose noise × 0.5 control is within REACH budgets gets what refuting it takes (docs/audit.md)
    reached = table(wanted, {key for n, key in others if n <= wanted})
    budget = spec.budget * REACH if needed is not None and cost(reached) <= spec.budget * REACH else spec.budget
    for k in range(len(others), -1, -1):
        within = {key for _, key in others[:k]}
        lo, hi = MIN_TRIALS, max(MIN_TRIALS, wanted)  # the most trials within the budget: bisect (cost grows with N)
        if cost(table(hi, within)) <= budget:
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if cost(table(mid, within)) <= budget else (lo, mid)
        if all(n <= lo for n, _ in others[:k]):
            break
    plan = table(lo, within)
    return TrialsPlan(lo, needed, control, (1 + len(ladder)) * seconds_per_trial, plan, needs, kind_seconds)


CONTROL_SHORT = {"control": "twin", "sigma_t10": "T/10", "noise_half": "×0.5", "no_clip": "no clip"}


def controls_trials(plan: TrialsPlan) -> str:
    """Each control's trials per world where they differ from the cell's, for `--dry-run`: `twin 100, T/10 100`
    (`n/m`: the Dirac canary's n, the input canary's m)."""
    cell = plan.table.get("cell", {})
    parts = []
    for key, by_kind in plan.table.items():
        if key == "cell" or by_kind == cell:
            continue
        white, black = by_kind.get("dirac"), by_kind.get("input")
        shown = [f"{n:,}" for n in dict.fromkeys(x for x in (white, black) if x is not None)]
        parts.append(f"{CONTROL_SHORT.get(key, key)} {'/'.join(shown)}")
    return ", ".join(parts) or "—"


def _control_need(control: controls.Control, algorithm: Algorithm, setting: Setting, model: Model, X: np.ndarray,
                  y: np.ndarray, need) -> int | None:
    """What refuting a control takes (`need(mechanism, its true ε, its derived)`): without clipping, the Dirac
    canary's raw gradient CLIP_PROBE × C goes through as if the noise were divided by CLIP_PROBE (its power)."""
    mechanism = control.algorithm
    if control.key == "no_clip":
        if not algorithm.tags.noise_scalable:
            return None
        mechanism = algorithm.with_noise_scale(1 / controls.CLIP_PROBE)
    assert mechanism is not None
    prepared = mechanism.prepare(setting, model, X, y, ReplicaStreams(range(1)))
    derived = (prepared.finish(prepared.theta).derived if prepared is not None
               else _fit(mechanism, setting, model, X, y, range(1))[1])
    return need(mechanism, derived.get("epsilon_noise_scaled"), derived)


def _power(algorithm: Algorithm, setting: Setting, derived: dict[str, Any], epsilon: float,
           delta: float) -> Any:
    """FPR ↦ the largest TPR of any test against the mechanism as it runs: from its dp_event's PLD privacy profile
    (`privacy.risk`) under add/remove; else the Gaussian trade-off curve through its (ε, δ) (exact for unsampled
    Gaussian mechanisms; under replace-one the profile would take RDP's δ at every ε, seconds per cell), or the
    (ε, δ) region of a pure claim."""
    event = algorithm.dp_event(setting, derived)
    if event is not None and algorithm.neighbouring() == "add_remove":
        profile, source = risk.privacy_profile(event, "add_remove", epsilon)
        if source == "pld":
            return lambda fpr: risk.tpr_bound(fpr, risk.EPSILON_GRID, profile)
    if delta > 0:
        mu = stats.gdp_mu_of_epsilon(epsilon, delta)
        return lambda fpr: float(scipy.stats.norm.cdf(scipy.stats.norm.ppf(fpr) + mu))
    return lambda fpr: risk.tpr_bound(fpr, epsilon, delta)


def _canary_model(model: Model) -> Model:
    """`model` with a gradient canary, for the plan its chains take."""
    return canaries.with_gradient_canaries(model, np.zeros((1, model.n_params)), np.zeros((1, 1)), 1.0)


def _fit_seconds(derived: dict[str, Any], setting: Setting, model: Model, chunk: int) -> float:
    """Estimated seconds of one replica's training by `fit` alone, from what its derived values say it did: the
    steps of a chain (`steps`, `sample_rate`, `backend`) and the iterations of every L-BFGS start (`start_results`,
    shared by the replicas of a chunk); the cost model above."""
    rate = derived.get("sample_rate")
    examples = max(1.0, float(rate) * setting.n if rate is not None else float(setting.batch_size or 1))
    compiled = derived.get("backend") == "numba"  # where the chain ran (`Chain.ran_on`), not how long it took
    chain = int(derived.get("steps", 0)) * (STEP_SECONDS[compiled]
                                             + examples * model.n_params * EXAMPLE_PARAMETER_SECONDS[compiled])
    iterations = sum(int(start["iterations"]) for start in derived.get("start_results", {}).values())
    solve = iterations * (LBFGS_ITERATION_SECONDS + setting.n * model.n_params * LBFGS_EXAMPLE_PARAMETER_SECONDS)
    return FIT_REPLICA_SECONDS + chain + solve / chunk


def _replica_seconds(prepared: Any, model: Model) -> float:
    """Estimated seconds of one replica's training of `prepared`'s chain on `model` (the cost model above)."""
    chain = prepared.chain
    compiled = backends.choose(backends.plan(chain, model, prepared.theta), chain.backend) is not backends.NUMPY
    per_step = STEP_SECONDS[compiled] + chain.examples_per_step * model.n_params * EXAMPLE_PARAMETER_SECONDS[compiled]
    return REPLICA_SECONDS + prepared.steps * per_step
