"""`dpsgd report`: the papers' claims checked against the computed runs (the verdicts: docs/results.md#claims)."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pandas as pd

from dpsgd_cli.audit import controls
from dpsgd_cli.audit.engine import VERDICTS
from dpsgd_cli.audit.run import read_audit_csv
from dpsgd_cli.config import NAME_PATTERN, ClaimSpec, FigureSpec
from dpsgd_cli.engine.analytic import analytic_table
from dpsgd_cli.engine.folder import write_text
from dpsgd_cli.engine.results import (
    NoResults,
    grid_of,
    json_object,
    note,
    read_results,
    result_folders,
    results_size,
    select,
)
from dpsgd_cli.engine.selection import results_frame, selections
from dpsgd_cli.engine.workers import map_in_workers
from dpsgd_cli.errors import printable
from dpsgd_cli.lazy import LazyModule

scipy_stats = LazyModule("scipy.stats")  # heavy: imported by the first F-test


PASS, FAIL, VACUOUS, NO_DATA = "PASS", "FAIL", "VACUOUS", "NO DATA"
STATUSES = (PASS, FAIL, VACUOUS, NO_DATA)
KINDS = {"finding": "findings", "formula_check": "formula checks"}


@dataclass(frozen=True)
class Verdict:
    grid: str
    claim: ClaimSpec
    status: str  # one of STATUSES
    numbers: str


# the characters Markdown reads as structure anywhere in a line: escapes, code, emphasis, links and images, HTML,
# entities, table cells; `_` only where it can open or close emphasis (not between two letters or digits)
_MARKUP = re.compile(r"[\\`*\[\]<>&|]|(?<![^\W_])_|_(?![^\W_])")
_LINE_START = re.compile(r"^([#+=-]|\d{1,9}[.)])")  # a heading, list, setext rule or ordered list at the start


def md_text(value: object) -> str:
    """Untrusted text as one line of literal Markdown, control characters as � (docs/results.md#reports)."""
    line = _MARKUP.sub(lambda m: "\\" + m.group(0), printable(" ".join(str(value).split())))
    return _LINE_START.sub(lambda m: m.group(0)[:-1] + "\\" + m.group(0)[-1], line)


def md_path(path: Path, root: Path) -> str:
    """`path` as a Markdown link target relative to `root` (percent-encoded: a space or `)` ends no link)."""
    return quote(path.relative_to(root).as_posix())


def summary_line(verdicts: list[Verdict]) -> str:
    """The counts of each verdict, findings apart from formula checks: `findings: 3 PASS, 1 FAIL, ...`."""
    parts = []
    for kind, label in KINDS.items():
        statuses = [v.status for v in verdicts if v.claim.kind == kind]
        if statuses or kind == "finding":
            parts.append(f"{label}: " + ", ".join(f"{statuses.count(s)} {s}" for s in STATUSES))
    return "; ".join(parts)


def claim_frame(folder: Path, claim: ClaimSpec, figures: list[FigureSpec]) -> pd.DataFrame:
    """The rows a claim reads: ok runs, their traces, or an analytic figure's table."""
    if claim.source not in ("runs", "traces"):
        figure = next((f for f in figures if f.name == claim.source), None)
        if figure is None:
            raise KeyError(f"claim {claim.id}: source {claim.source!r} is neither runs, traces "
                           "nor a figure of the grid")
        return analytic_table(folder, figure)
    frame = results_frame(folder, traces=claim.source == "traces")
    named = any("selection" in sel for sel in (claim.where, claim.a, claim.b))
    if "selection" in frame and frame["selection"].nunique() > 1 and not named:  # one protocol, the grid's first
        frame = frame[frame["selection"] == frame["selection"].iloc[0]]
    return frame


def _stats(frame: pd.DataFrame, metric: str, over: str | None) -> pd.DataFrame:
    """mean, std, n of the metric at each value of `over` (or overall)."""
    keys = frame[over] if over else pd.Series(0, index=frame.index)
    out = frame.groupby(keys)[metric].agg(["mean", "std", "count"]).rename(columns={"count": "n"})
    return out.fillna({"std": 0.0})


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _cell(stats: pd.Series) -> str:
    return f"{_fmt(stats['mean'])} ± {_fmt(stats['std'])} (n={int(stats['n'])})"


def _span(values: pd.Series) -> tuple[float, float]:
    """(max − min, floating-point slack) of the finite values (nan span when there is none)."""
    finite = values[np.isfinite(values.to_numpy(dtype=float))]
    if finite.empty:
        return math.nan, 0.0
    return float(finite.max() - finite.min()), 1e-9 * float(finite.abs().max())


def _flat(stats: pd.DataFrame, claim: ClaimSpec) -> str | None:
    """Why a monotone or fluctuates curve is vacuous (its means span at most the tolerance), else None."""
    span, slack = _span(stats["mean"])
    if math.isnan(span):
        return f"no finite {claim.metric} at any {claim.over}"
    if span <= claim.tolerance + slack:
        return (f"{claim.metric} spans {_fmt(span)} over {len(stats)} values of {claim.over} (≤ tolerance "
                f"{claim.tolerance:g}): no step moves either way")
    return None


def _one_value(claim: ClaimSpec, *stats: pd.DataFrame) -> str | None:
    """Why a comparison is vacuous (no finite mean, or one value on every compared row), else None."""
    span, slack = _span(pd.concat([s["mean"] for s in stats]))
    if math.isnan(span):
        return f"no finite {claim.metric} in the compared rows"
    if span <= slack and all((s["std"] <= slack).all() for s in stats):
        value = next(float(m) for s in stats for m in s["mean"] if np.isfinite(m))
        return f"{claim.metric} is {_fmt(value)} on every compared row: it responds to nothing the claim varies"
    return None


def _check_group(frame: pd.DataFrame, claim: ClaimSpec, limit: float | None) -> tuple[bool | None | str, str]:
    """(holds, numbers) for one group; holds None when there is nothing to compare, else True, False or VACUOUS."""
    frame = select(frame, claim.where)
    if claim.check == "saturates":
        series = select(frame, claim.a).sort_values(claim.over)[claim.metric]
        if series.empty or limit is None:
            return None, "no curve or no limit"
        if (why := _one_value(claim, pd.DataFrame({"mean": series, "std": 0.0}))) is not None:
            return VACUOUS, why
        last = float(series.iloc[-1])
        holds = last >= (1 - claim.tolerance) * limit and float(series.max()) <= limit * (1 + 1e-9)
        return holds, f"last {claim.metric} = {_fmt(last)} vs limit {_fmt(limit)} (tolerance {claim.tolerance:g})"
    a = _stats(select(frame, claim.a), claim.metric, claim.over)
    if claim.check == "fluctuates":
        return _fluctuates(a, claim)
    if claim.check in ("above", "below"):
        return _level(a, claim)
    if claim.check == "monotone":
        if len(a) < 2:
            return None, f"{len(a)} value(s) of {claim.over}"
        if (why := _flat(a, claim)) is not None:
            return VACUOUS, why
        steps = a["mean"].diff().dropna()
        steps = steps if claim.direction == "increasing" else -steps
        keys = list(a.index)
        if len(keys) > 8:  # a long curve: its ends and its worst step
            keys = sorted(set(keys[:3] + [steps.idxmin()] + keys[-3:]))
        text = " → ".join(f"{claim.over}={k:g}: {_cell(a.loc[k])}" for k in keys)
        if len(a) > 8:
            text += f" ({len(a)} values; worst step {_fmt(float(steps.min()))} at {claim.over}={steps.idxmin():g})"
        return bool((steps >= -claim.tolerance).all()), text
    b = _stats(select(frame, claim.b), claim.metric, claim.over)
    common = a.index.intersection(b.index)
    if common.empty:
        return None, f"a: {len(a)} value(s), b: {len(b)} value(s) of {claim.over}, none in common"
    a, b = a.loc[common], b.loc[common]
    if claim.check == "spread" and ((a["std"] == 0).all() and (b["std"] == 0).all()):
        return VACUOUS, f"neither a nor b varies over seeds: {claim.metric} has no spread to compare"
    if claim.check != "spread" and (why := _one_value(claim, a, b)) is not None:
        return VACUOUS, why
    if claim.check == "widens":
        return _widens(a, b, claim)
    parts, oks = [], []
    for key in common:
        sa, sb = a.loc[key], b.loc[key]
        diff = sa["mean"] - sb["mean"]
        se = _diff_se(sa, sb)
        where = f"{claim.over}={key:g}: " if claim.over else ""
        if claim.check == "spread":
            ok, text = _spread(sa, sb, claim)
            parts.append(f"{where}{text}")
        elif claim.check == "better":
            gain = diff if claim.higher_is_better else -diff
            ok = gain > claim.tolerance + 2 * se
            parts.append(f"{where}a {_cell(sa)} vs b {_cell(sb)}, gain {_fmt(gain)} (2·SE {_fmt(2 * se)})")
        elif claim.check == "not_worse":
            bound = claim.tolerance * (abs(sb["mean"]) if claim.relative else 1.0)
            gain = (diff if claim.higher_is_better else -diff) + 0.0  # + 0.0: equal means print 0, not -0
            ok = gain >= -bound
            parts.append(f"{where}a {_cell(sa)} vs b {_cell(sb)}, gain {_fmt(gain)} (≥ {_fmt(-bound)}?)")
        else:  # within
            bound = claim.tolerance * (abs(sb["mean"]) if claim.relative else 1.0)
            ok = abs(diff) <= bound
            parts.append(f"{where}a {_cell(sa)} vs b {_cell(sb)}, |a − b| = {_fmt(abs(diff))} (≤ {_fmt(bound)}?)")
        oks.append(bool(ok))
    return all(oks), _pointwise(parts, oks, claim)


def _pointwise(parts: list[str], oks: list[bool], claim: ClaimSpec) -> str:
    """The numbers at every value of `over`, or for a long curve its ends and its first failures."""
    if len(parts) <= 8:
        return "; ".join(parts)
    failing = [i for i, ok in enumerate(oks) if not ok]
    shown = sorted({0, 1, 2, len(parts) - 3, len(parts) - 2, len(parts) - 1, *failing[:3]})
    return "; ".join(parts[i] for i in shown) + (f" ({len(parts)} values of {claim.over}; it fails at "
                                                 f"{len(failing)})")


def _level(stats: pd.DataFrame, claim: ClaimSpec) -> tuple[bool | None | str, str]:
    """`above` / `below`: the mean of `a` against the level `value` (± tolerance) at every value of `over`."""
    if stats.empty:
        return None, "no rows in a"
    if not np.isfinite(stats["mean"].to_numpy(dtype=float)).any():
        return VACUOUS, f"no finite {claim.metric} in a"
    sign, mark = (1.0, ">") if claim.check == "above" else (-1.0, "<")
    bar = claim.value + sign * claim.tolerance
    parts, oks = [], []
    for key, row in stats.iterrows():
        where = f"{claim.over}={key:g}: " if claim.over else ""
        oks.append(bool(sign * (row["mean"] - bar) > 0))
        parts.append(f"{where}{claim.metric} {_cell(row)} ({mark} {_fmt(bar)}?)")
    return all(oks), _pointwise(parts, oks, claim)


def check_conditions(frame: pd.DataFrame, claim: ClaimSpec,
                     limit: float | None) -> tuple[bool | None | str, str]:
    """(holds, numbers) of one group under every condition of the claim (its check and `also:`)."""
    if not claim.also:
        return _check_group(frame, claim, limit)
    found = [(c, *_check_group(frame, c, limit)) for c in claim.conditions()]
    marks = {True: "✓", False: "✗", None: "?", VACUOUS: "○"}
    text = " AND ".join(f"({i + 1}) {c.check if i == 0 else c.text}: {marks[h]} {numbers}"
                        for i, (c, h, numbers) in enumerate(found))
    held = [h for _, h, _ in found]
    if False in held:
        return False, text
    if all(h is True for h in held):
        return True, text
    return (VACUOUS if VACUOUS in held else None), text


def _diff_se(s0: pd.Series, s1: pd.Series) -> float:
    """Standard error of the difference of two means over independent seeds."""
    return math.sqrt(s0["std"] ** 2 / s0["n"] + s1["std"] ** 2 / s1["n"])


def _few_seeds(*stats: pd.DataFrame) -> str | None:
    """Why a check against the seed noise cannot be decided (fewer than 2 seeds somewhere), else None."""
    low = min(int(s["n"].min()) for s in stats)
    return f"{low} seed(s) at some {stats[0].index.name or 'point'}: the seed noise is unknown (needs ≥ 2)" \
        if low < 2 else None


def _fluctuates(stats: pd.DataFrame, claim: ClaimSpec) -> tuple[bool | None | str, str]:
    """`fluctuates`: some consecutive step of the mean goes against `direction` by more than tolerance + 2·SE."""
    if len(stats) < 2:
        return None, f"{len(stats)} value(s) of {claim.over}"
    if (why := _flat(stats, claim)) is not None:
        return VACUOUS, why
    if (why := _few_seeds(stats)) is not None:
        return None, why
    sign = 1.0 if claim.direction == "increasing" else -1.0
    keys = list(stats.index)
    steps = []  # (excess over tolerance + 2·SE, text)
    for k0, k1 in zip(keys, keys[1:]):
        s0, s1 = stats.loc[k0], stats.loc[k1]
        back, bar = -sign * (s1["mean"] - s0["mean"]), claim.tolerance + 2 * _diff_se(s0, s1)
        steps.append((back - bar, f"{claim.over}={k0:g} → {k1:g}: {_cell(s0)} → {_cell(s1)}, against the "
                                  f"{claim.direction} trend by {_fmt(back)} (> {_fmt(bar)}?)"))
    found = [text for excess, text in steps if excess > 0]
    if found:
        return True, f"{len(found)} of {len(steps)} steps reverse: " + "; ".join(found[:3])
    return False, "no step reverses beyond the noise; the closest: " + max(steps)[1]


def _widens(a: pd.DataFrame, b: pd.DataFrame, claim: ClaimSpec) -> tuple[bool | None, str]:
    """`widens`: the gain a − b (or b − a) has a weighted least-squares slope along log(over) (over if some value
    is ≤ 0), weights 1/SE_k², above tolerance + 2·SE(slope), SE(slope)² = 1/Σ w_k (x_k − x̄_w)²."""
    if len(a) < 3:
        return None, f"{len(a)} common value(s) of {claim.over} (a slope needs 3)"
    if (why := _few_seeds(a, b)) is not None:
        return None, why
    sign = 1.0 if claim.higher_is_better else -1.0
    gains = sign * (a["mean"] - b["mean"])
    se = pd.Series([_diff_se(a.loc[k], b.loc[k]) for k in a.index], index=a.index)
    if (se <= 0).any():
        return None, f"no seed noise at {claim.over}={se.idxmin():g}: the weights 1/SE² are undefined"
    keys = np.asarray(a.index, dtype=float)
    x = np.log(keys) if (keys > 0).all() else keys
    w = 1.0 / se.to_numpy() ** 2
    xc = x - np.sum(w * x) / np.sum(w)
    slope = float(np.sum(w * xc * gains.to_numpy()) / np.sum(w * xc**2))
    bar = claim.tolerance + 2.0 / math.sqrt(float(np.sum(w * xc**2)))
    curve = ", ".join(f"{k:g}: {_fmt(g)} ± {_fmt(e)}" for (k, g), e in zip(gains.items(), se))
    against = f"log {claim.over}" if (keys > 0).all() else claim.over
    return slope > bar, (f"gain of a over b (± SE) by {claim.over}: {curve}; weighted slope against {against} "
                         f"{_fmt(slope)} (> {_fmt(bar)} = tolerance + 2·SE?)")


def spread_ratio_bounds(s_a: float, n_a: int, s_b: float, n_b: int, confidence: float) -> tuple[float, float, float]:
    """(s_a/s_b, one-sided lower and upper bounds at `confidence`) of the ratio of standard deviations, by the
    variance-ratio F-test: (s_a²/σ_a²)/(s_b²/σ_b²) ~ F(n_a − 1, n_b − 1), so σ_a/σ_b ≥ √(F / F_conf)."""
    if n_a < 2 or n_b < 2:
        raise ValueError(f"spread needs at least 2 seeds per selection, got {n_a} and {n_b}")
    if s_b == 0:
        return (math.inf, math.inf if s_a > 0 else 0.0, math.inf)
    F = (s_a / s_b) ** 2
    lower = math.sqrt(F / scipy_stats.f.ppf(confidence, n_a - 1, n_b - 1))
    upper = math.sqrt(F / scipy_stats.f.ppf(1 - confidence, n_a - 1, n_b - 1))
    return math.sqrt(F), lower, upper


def _spread(sa: pd.Series, sb: pd.Series, claim: ClaimSpec) -> tuple[bool, str]:
    """`spread`: a's std over seeds exceeds b's by more than the tolerance, at the claim's confidence."""
    ratio, lower, upper = spread_ratio_bounds(float(sa["std"]), int(sa["n"]), float(sb["std"]), int(sb["n"]),
                                              claim.confidence)
    pct = f"{100 * claim.confidence:g}%"
    text = (f"std a {_fmt(sa['std'])} (n={int(sa['n'])}) vs b {_fmt(sb['std'])} (n={int(sb['n'])}): "
            f"ratio {_fmt(ratio)}, one-sided {pct} lower bound {_fmt(lower)} (> {_fmt(1 + claim.tolerance)}?), "
            f"upper {_fmt(upper)}")
    return lower > 1 + claim.tolerance, text


def evaluate(folder: Path, claim: ClaimSpec, figures: list[FigureSpec]) -> Verdict:
    grid = Path(folder).name
    try:
        frame = claim_frame(folder, claim, figures)
        if frame.empty and claim.source in ("runs", "traces"):
            reason = read_results(folder).why_empty() or f"no {claim.source} rows"
            return Verdict(grid, claim, NO_DATA, reason)
        limit = _limit(claim, figures)
        status, numbers = decide(_groups(frame, claim, limit), claim)
        candidates = _selected_by(folder, claim)
        if candidates:
            fixed = [(label, *decide(_groups(rows, claim, limit), claim)[:1])
                     for label, rows in fixed_candidates(results_frame(folder, traces=claim.source == "traces",
                                                                         select=False), candidates)]
            status, effect = selection_effect(status, fixed, candidates, claim)
            numbers += effect
    except (KeyError, ValueError) as exc:
        return Verdict(grid, claim, NO_DATA, str(exc).strip("'\""))
    return Verdict(grid, claim, status, numbers + _mixed_footings(frame, claim))


def _groups(frame: pd.DataFrame, claim: ClaimSpec, limit: float | None) -> list[tuple[bool | None | str, str]]:
    """(holds, numbers) of each group of the claim, the groups where it fails first."""
    groups = list(frame.groupby(claim.group_by, sort=True)) if claim.group_by else [((), frame)]
    results = []
    for key, group in groups:
        holds, numbers = check_conditions(group, claim, limit)
        name = ", ".join(f"{k}" for k in (key if isinstance(key, tuple) else (key,)))
        mark = {True: "✓", False: "✗", None: "?", VACUOUS: "○"}[holds]
        results.append((holds, f"{mark} [{name}] {numbers}" if claim.group_by else numbers))
    results.sort(key=lambda item: item[0] is not False)  # the groups where the claim fails come first
    return results


def _selected_by(folder: Path, claim: ClaimSpec) -> list[str]:
    """The candidates (e.g. [epochs]) of the selection a claim's runs went through; [] when none did."""
    if claim.source not in ("runs", "traces") or any("selection" in sel for sel in (claim.where, claim.a, claim.b)):
        return []
    specs = selections(grid_of(folder))
    return list(specs[0].candidates) if specs else []


def fixed_candidates(runs: pd.DataFrame, candidates: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """The unselected runs at each fixed value of the candidates ("epochs=2", its rows); a row without a value
    (a non-private reference) belongs to every one."""
    present = [c for c in candidates if c in runs]
    if not present or runs.empty:
        return []
    keys = runs[present].dropna().drop_duplicates().sort_values(present)
    out = []
    for _, key in keys.iterrows():
        mask = pd.Series(True, index=runs.index)
        for column in present:
            mask &= (runs[column] == key[column]) | runs[column].isna()
        out.append((", ".join(f"{c}={key[c]:g}" if isinstance(key[c], float) else f"{c}={key[c]}"
                              for c in present), runs[mask]))
    return out


def selection_effect(status: str, fixed: list[tuple[str, str]], candidates: list[str],
                     claim: ClaimSpec) -> tuple[str, str]:
    """(status, text): the verdict at each fixed candidate value beside the selected one (`unselected:`)."""
    if not fixed:
        return status, ""
    names = " × ".join(candidates)
    text = f"; unselected runs at fixed {names}: " + ", ".join(f"{label} {s}" for label, s in fixed)
    decided = [s for _, s in fixed if s in (PASS, FAIL)]
    holds = {"show": PASS in decided, "some": PASS in decided,
             "all": bool(decided) and FAIL not in decided}[claim.unselected]
    if status != PASS or holds or not decided:
        return status, text
    if claim.unselected == "show":
        return status, text + f" — this PASS rests on the selection's choice of {names}: no fixed {names} passes"
    need = "some" if claim.unselected == "some" else "every"
    return FAIL, text + (f" — FAIL: the claim holds through the choice of {names} only, and must also hold at "
                         f"{need} fixed {names}")


def _mixed_footings(frame: pd.DataFrame, claim: ClaimSpec) -> str:
    """A warning when the private rows a claim compares state their ε under different neighbouring relations or
    accountants (their ε are then not on one footing)."""
    if "epsilon" not in frame:
        return ""
    # a selection the check does not use (`b` of a monotone claim) may name no column: it selects nothing here
    parts = [select(frame, sel) for sel in (claim.a, claim.b) if sel and set(sel) <= set(frame)] or [frame]
    rows = pd.concat(parts)
    rows = rows[rows["epsilon"].notna()]
    warnings = ""
    for column, what in (("neighbours", "mixed neighbouring relations"), ("accountant", "mixed accountants")):
        values = sorted(set(rows[column].fillna("unrecorded").astype(str))) if column in rows else []
        warnings += f" [{what}: {', '.join(values)}]" if len(values) > 1 else ""
    return warnings



def decide(results: list[tuple[bool | None | str, str]], claim: ClaimSpec) -> tuple[str, str]:
    """(status, numbers) of a claim from its groups': VACUOUS and undecided groups count neither way."""
    decided = [h for h, _ in results if isinstance(h, bool)]
    vacuous = sum(h == VACUOUS for h, _ in results)
    if decided:
        status = PASS if quantified(decided, claim.quantifier) else FAIL
    else:
        status = VACUOUS if vacuous else NO_DATA
    numbers = "; ".join(text for _, text in results) or "no rows"
    if claim.group_by and (decided or vacuous):
        need = {"all": "all", "most": "more than half", "some": "at least one"}[claim.quantifier]
        apart = f" ({vacuous} vacuous, not counted)" if vacuous else ""
        numbers = f"{decided.count(True)} of {len(decided)} groups hold ({need} must){apart}: {numbers}"
    return status, numbers


def quantified(decided: list[bool], quantifier: str) -> bool:
    """Whether enough groups hold: all of them, most (strictly more than half), or some (at least one)."""
    held = sum(decided)
    return {"all": held == len(decided), "most": 2 * held > len(decided), "some": held >= 1}[quantifier]


def _limit(claim: ClaimSpec, figures: list[FigureSpec]) -> float | None:
    """The saturation value α S_g²/(λσ²n²) of a privacy-curve figure's parameters (what `saturates` compares)."""
    figure = next((f for f in figures if f.name == claim.source), None)
    if figure is None or figure.kind != "privacy_curve":
        return None
    p = {"alpha": 30, "sigma": 0.02, "sensitivity": 4, "lam": 1, "n": 5000, **figure.params}
    return p["alpha"] * p["sensitivity"] ** 2 / (p["lam"] * p["sigma"] ** 2 * p["n"] ** 2)


def build_report(path: Path, jobs: int = 1) -> tuple[list[Verdict], Path]:
    """Evaluate the claims of every grid under `path` and write `path/report.md`; with `jobs` > 1, the grids'
    claims are evaluated in that many worker processes (forked), the largest grid first."""
    path = Path(path)
    verdicts: list[Verdict] = []
    intro = ["# dpsgd reproduction report", "",
             "Each claim of the papers is checked against the runs in this folder: PASS or FAIL with the numbers "
             "behind it (mean ± std over seeds; `better` needs a gain larger than the tolerance plus twice the "
             "standard error of the difference; `spread` a one-sided F-test lower bound on the ratio of standard "
             "deviations above 1 + tolerance). VACUOUS: the compared values carry no evidence either way (a curve "
             "flat within the tolerance, a metric with one value on every compared row, or none finite). A "
             "*reading* says how a quote was encoded where that is a choice. Formula checks re-evaluate a formula "
             "the project implements (no data, no randomness); they are tabled and counted apart.", ""]
    sections = []
    audits = audit_lines(path)
    try:
        folders = result_folders(path)
    except NoResults:
        if not audits:
            raise
        folders = []  # an audit alone is worth a report
    for found, section in map_in_workers(functools.partial(_grid_part, root=path), folders, jobs, cost=results_size):
        verdicts += found
        sections += section
    formulas = [v for v in verdicts if v.claim.kind == "formula_check"]
    if formulas:
        sections += ["## Formula checks", "",
                     "Each re-evaluates a source's formula as the project implements it (an analytic figure's table, "
                     "or a noise scale calibrated without data): a PASS says the implementation behaves as the source "
                     "says the formula does, not that an experiment reproduced a finding.", "",
                     *_table(formulas, grid_column=True), ""]
    summary = [f"**{summary_line(verdicts)}**", ""] if verdicts else []
    out = path / "report.md"
    write_text(out, "\n".join(intro + summary + sections + audits) + "\n")
    return verdicts, out


def _grid_part(folder: Path, root: Path) -> tuple[list[Verdict], list[str]]:
    """A grid's verdicts and its section of the report."""
    for line in read_results(folder).notes():
        note(line)
    grid = grid_of(folder)
    figures = [FigureSpec(**f) for f in grid.get("figures", [])]
    claims = [ClaimSpec(**c) for c in grid.get("claims", [])]
    found = [evaluate(folder, claim, figures) for claim in claims]
    return found, _section(folder, root, grid, figures, [v for v in found if v.claim.kind == "finding"])


def _section(folder: Path, root: Path, grid: dict, figures: list[FigureSpec], verdicts: list[Verdict]) -> list[str]:
    lines = [f"## {md_text(folder.name)}", ""]
    if grid.get("description"):
        lines += [md_text(grid["description"]), ""]
    shown = figures or [FigureSpec(name=p.stem) for p in sorted((folder / "figures").glob("*.png"))
                        if NAME_PATTERN.fullmatch(p.stem)]  # a file the tool did not name is no figure
    for figure in shown:
        image = folder / "figures" / f"{figure.name}.png"
        if image.exists():
            lines += [f"### {md_text(figure.title or figure.name)}", ""]
            if figure.paper:
                lines += [f"*The paper:* {md_text(figure.paper)}", ""]
            lines += [f"![{md_text(figure.name)}]({md_path(image, root)})", ""]
    if verdicts:
        lines += [*_table(verdicts), ""]
    return lines + risk_lines(folder)


RISK_COLUMNS = ("tpr_bound_fpr_1e-2", "tpr_bound_fpr_1e-3", "gdp_mu")


def risk_lines(folder: Path) -> list[str]:
    """A grid's attack risk beside ε (docs/accounting.md#attack-risk): per private line and ε, the largest over its
    runs of the accountant's bound on a membership test's TPR at FPR 10⁻² and 10⁻³, and of μ; empty without private
    runs (or for results written before the columns)."""
    runs = results_frame(folder)
    if not set(RISK_COLUMNS) <= set(runs.columns) or runs["tpr_bound_fpr_1e-2"].isna().all():
        return []
    private = runs[runs["tpr_bound_fpr_1e-2"].notna()]
    table = private.groupby(["label", "epsilon"], sort=True)[list(RISK_COLUMNS)].max()
    lines = ["### Attack risk beside ε", "",
             "The largest true-positive rate any membership test can have at a false-positive rate of 10⁻² and "
             "10⁻³, by the accountant's privacy profile of each run's mechanism (the largest over a line's runs at "
             "that ε), and the μ of μ-GDP through its (ε, δ) (exact for one Gaussian mechanism, the CLT reading for "
             "DP-SGD): docs/accounting.md#attack-risk.", "",
             "| line | ε | TPR at FPR 10⁻² ≤ | TPR at FPR 10⁻³ ≤ | μ |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {md_text(label)} | {_fmt(epsilon)} | {_fmt3(row['tpr_bound_fpr_1e-2'])} | "
              f"{_fmt3(row['tpr_bound_fpr_1e-3'])} | {_fmt3(row['gdp_mu'])} |"
              for (label, epsilon), row in table.iterrows()]
    return lines + [""]


def _fmt3(value: float) -> str:
    return "—" if pd.isna(value) else f"{value:.3g}"


def _table(verdicts: list[Verdict], grid_column: bool = False) -> list[str]:
    """A markdown table of verdicts: the claim with its source and reading, the verdict, the numbers."""
    head = ["grid"] * grid_column + ["claim", "verdict", "numbers"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for v in verdicts:
        cells = [md_text(v.grid)] * grid_column + [
            f"**{md_text(v.claim.id)}**: {md_text(v.claim.text)}{_source_of(v.claim)}", v.status, md_text(v.numbers)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _source_of(claim: ClaimSpec) -> str:
    """The quoted source sentence under the claim (or the mark of the project's own check), then its reading."""
    source = "<br>*(the project's own check)*" if claim.own else f"<br>*{md_text(claim.quote)}*"
    return source + (f"<br>reading: {md_text(claim.reading)}" if claim.reading else "")


# --- the audit's verdicts (`dpsgd audit` → audit.csv) ---------------------------------------------------------

def audit_frames(path: Path) -> list[pd.DataFrame]:
    """Every audit.csv at `path` or in its sub-folders."""
    path = Path(path)
    files = [path / "audit.csv"] if (path / "audit.csv").exists() else sorted(path.glob("*/audit.csv"))
    return [read_audit_csv(f) for f in files]


def audit_verdicts(frame: pd.DataFrame) -> list[dict]:
    """Per grid, dataset, model, algorithm (with its parameters) and claimed ε: the verdict of its rows, the first
    of refuted, consistent, uninformative, not covered (docs/audit.md); files without verdicts: refuted when
    ε_lo > ε, else consistent."""
    ok = frame[(frame["status"] == "ok") & frame["epsilon_lo"].notna()]
    out = []
    keys = ["grid", "dataset", "model", "algorithm", "algorithm_params", "epsilon_claimed"]
    if "algorithm_params" not in ok:
        ok = ok.assign(algorithm_params="{}")
    if "verdict" not in ok:
        ok = ok.assign(verdict=np.where(ok["epsilon_lo"] > ok["epsilon_claimed"], "refuted", "consistent"),
                       reason="")
    for key, group in ok.groupby(keys, sort=True):
        verdict, best, reason = claim_verdict(group)
        sign = ">" if best["epsilon_lo"] > best["epsilon_claimed"] else "≤"
        family = (f"confidence {_fmt(best['confidence'])} for the family of {int(best['family_size'])} row(s)"
                  if "family_size" in best and pd.notna(best.get("family_size")) else
                  f"confidence {_fmt(best['confidence'])} per audit")
        trials = (f"one run: {int(best['trials'])} training(s), the f-DP test with the (ε, δ) curve"
                  if best.get("statistic") == "one_run" else f"{int(best['trials'])} + {int(best['trials'])} trials")
        out.append({**dict(zip(keys, key)), "verdict": verdict, "reason": reason,
                    "numbers": f"ε_lo = {_fmt(best['epsilon_lo'])} {sign} {_fmt(best['epsilon_claimed'])} = ε "
                               f"(δ = {_fmt(best['delta'])}; {best['canary']} canary, {best['threat_model']}; "
                               f"{trials}, {family}; "
                               f"{len(group)} audit(s))" + (f"; {reason}" if reason else "") + _tpr_beside(best)})
    return out


def claim_verdict(group: pd.DataFrame) -> tuple[str, pd.Series, str]:
    """One claim's audit rows (ok, with a bound and a verdict) → (its verdict: the first of refuted, consistent,
    uninformative, not covered; the row it rests on, the largest ε_lo of that verdict; the reason: that row's, or
    for consistent what the audit would have caught over the claim's covered rows)."""
    verdict = next(v for v in VERDICTS if (group["verdict"] == v).any() or v == "not covered")
    chosen = group[group["verdict"] == verdict]
    best = chosen.loc[chosen["epsilon_lo"].idxmax()] if len(chosen) else group.iloc[0]
    reason = best.get("reason") if isinstance(best.get("reason"), str) else ""
    if verdict == "consistent":  # (an audit.csv without the controls' columns: the row's own reason)
        reason = controls.caught_and_missed(group[group["verdict"] != "not covered"].to_dict("records")) or reason
    return verdict, best, reason


def _tpr_beside(row: pd.Series) -> str:
    """The audit's measured TPR at FPR 10⁻³ beside the accountant's bound on it, where audit.csv has both."""
    measured, bound = row.get("tpr_at_fpr_1e-3"), row.get("tpr_bound_fpr_1e-3")
    if measured is None or bound is None or pd.isna(measured) or pd.isna(bound):
        return ""
    return f"; TPR at FPR 10⁻³: {_fmt3(measured)} measured, ≤ {_fmt3(bound)} by the accountant"


def audit_lines(path: Path) -> list[str]:
    """The report's audit section (empty without audit.csv)."""
    verdicts = [v for frame in audit_frames(path) for v in audit_verdicts(frame)]
    if not verdicts:
        return []
    lines = ["## Privacy audit (`dpsgd audit`)", "",
             "Empirical lower bounds ε_lo beside each claimed ε: refuted when ε_lo > ε on a threat model the claim "
             "covers; consistent only when the same audit refuted the cell's broken twin (its noise scaled down), "
             "with what else it would have caught of the realistic controls (σ for T/10 steps, noise × 0.5, no "
             "clipping), "
             "else uninformative; not covered when the attack sees more than the claim is about. A consistent "
             "verdict is no proof of privacy.", "",
             "| grid | dataset | model | algorithm | ε claimed | verdict | numbers |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {md_text(v['grid'])} | {md_text(v['dataset'])} | {md_text(v['model'])} | "
              f"{md_text(v['algorithm'])} {md_text(_params(v))} | {_fmt(v['epsilon_claimed'])} | "
              f"{'**REFUTED**' if v['verdict'] == 'refuted' else v['verdict']} | {md_text(v['numbers'])} |"
              for v in verdicts]
    # a grid's figures are those of a folder of `path` it names: not `..`, not an absolute path
    grids = {str(v["grid"]) for v in verdicts if NAME_PATTERN.fullmatch(str(v["grid"]))}
    for folder in sorted({Path(path) / grid for grid in grids} | {Path(path)}):
        image = folder / "figures" / "audit.png"
        if image.exists():
            lines += ["", f"![audit]({md_path(image, Path(path))})"]
    return lines + [""]


def _params(verdict: dict) -> str:
    """An algorithm's non-default-looking parameters, compact (`{}` → nothing)."""
    params = json_object(verdict.get("algorithm_params")) or {}
    shown = ", ".join(f"{k}={v}" for k, v in params.items() if v is not None)
    return f"({shown})" if shown else ""
