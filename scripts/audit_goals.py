"""Print the audit's goals, measured: run from the repository root after
`dpsgd audit experiments.yaml --only audit --only audit_power --out RESULTS`.

    python scripts/audit_goals.py [RESULTS]        (RESULTS: default results)

1. the `audit` grid: every dp_sgd cell's positive control refuted; no sound algorithm refuted; the all-iterates
   rows of bolt_on and output_perturbation `not covered` (read from RESULTS/audit/audit.csv);
2. DP-SGD with the noise removed (noise scale 0) refuted in every dp_sgd cell of `audit` at ε ≤ 1 under a
   white-box threat model (audited here, the grid's own audit block);
3. false refutations over simulated exactly tight mechanisms, for a fixed threshold and for the rule `order`
   (`tests/test_audit_power.py` asserts both);
4. one full-batch DP-SGD step (`audit_power`, read from RESULTS/audit_power/audit.csv): ε_lo ≥ 0.65·ε, the GDP
   estimate ≥ 0.75·ε;
5. one-run mode: the dp_sgd cells of `audit` at ε ≤ 1 with 100 Dirac canaries per training pooled over 10
   trainings — the sound mechanism, its twin and the noiseless one (audited here).
6. one run at δ = 1e-5: 10⁴ Dirac canaries in a single training of one full-batch DP-SGD step at ε = 4 (the
   `audit_power` cell): ε_lo (the f-DP test with the (ε, δ) curve, the verdict's), Steinke et al.'s bound and the
   μ-GDP curve's (valid here: one Gaussian step), and the twin's from its own single training, the first two also
   over 25 fresh draws of that step's exact scores (b + σz); then the same on
   the `audit` grid's dp_sgd cell at ε = 4 (a Poisson-subsampled chain, where the μ-GDP curve is not valid);
7. one step at δ = 1e-5, ε = 1, 2, 4: the rule `order` with 2 × 10⁵ trials — one real audit each (timed), then
   the median over 25 fresh draws of that step's exact scores (N(b, σ²), b the canary's inclusion).

    python scripts/audit_goals.py --one-run-and-step      (sections 6 and 7 only; no RESULTS needed)
8. the ladder of controls (σ for T/10 steps, noise × 0.5, no clipping): refuted or not on the `audit` grid's
   dp_sgd cells at ε ≤ 1 (read from RESULTS/audit/audit.csv) and on adult (3,000 records, B = 64, 3 epochs,
   ε = 1, δ = 1e-5, the default audit; audited here: set DPSGD_DATA_MIRROR or have adult cached).
9. full training, white box, all iterates, dp_sgd on adult (3,000 records, B = 64, 3 epochs, δ = 1e-5) at
   ε = 2 and 4: ε_lo over the trials a world (the Dirac canary, the real audit, timed; also with σ calibrated by
   the PLD accountant, at 20,000), then the bound: the likelihood ratio against Σ_t x_t and max_t x_t, the median
   over fresh draws of the all-iterates score from its exact law (x_t = b_t + σz_t, b_t ~ Bernoulli(q); no
   training) for the tool's rule and for an oracle's one rank, and at the expected counts of the most powerful
   test (the mechanism's PLD trade-off curve): the tool's rule, the best single rank fixed in advance, and
   ln((TPR − δ)/FPR) itself.

    python scripts/audit_goals.py --full-training  (section 9 only, 9 to 16 minutes under load; set
                                                    DPSGD_DATA_MIRROR or have adult cached)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.stats

from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.audit import canaries, stats
from dpsgd_cli.audit.engine import audit_cell, dirac_setup
from dpsgd_cli.config import AuditSpec, GridFile, expand, load_grid_file, select
from dpsgd_cli.engine.runner import dataset
from dpsgd_cli.privacy import risk


def main(results: Path) -> None:
    from dpsgd_cli.audit import stats
    from dpsgd_cli.audit.engine import audit_cell
    from dpsgd_cli.config import AuditSpec, expand, load_grid_file, select

    frame = pd.read_csv(results / "audit" / "audit.csv")
    ok = frame[frame["status"] == "ok"]
    cells = ok.groupby("cell_id")
    dp = ok[ok["algorithm"] == "dp_sgd"]
    refuted_controls = dp.groupby("cell_id").apply(lambda g: (g["control_epsilon_lo"] > g["epsilon_claimed"]).any())
    print(f"1a. dp_sgd cells whose positive control (noise x {dp['control'].iloc[0]:g}) is refuted: "
          f"{int(refuted_controls.sum())} / {len(refuted_controls)}")
    for _cell_id, group in dp.groupby("cell_id"):
        best = group.loc[group["control_epsilon_lo"].idxmax()]
        print(f"    ε = {best['epsilon']:g}: twin's ε = {best['control_epsilon']:.3g}, its ε_lo = "
              f"{best['control_epsilon_lo']:.3f} ({best['canary']}, {best['threat_model']})")
    print(f"1b. rows with verdict refuted: {int((ok['verdict'] == 'refuted').sum())} of {len(ok)}")
    every = ok[ok["algorithm"].isin(["bolt_on", "output_perturbation"])
               & (ok["threat_model"] == "white-box, all iterates")]
    print(f"1c. bolt_on / output_perturbation all-iterates rows `not covered`: "
          f"{int((every['verdict'] == 'not covered').sum())} / {len(every)} "
          f"(output_perturbation has none: the Dirac canary is not applicable without iterates)")
    order = ("refuted", "consistent", "uninformative", "not covered")
    verdicts = cells.apply(lambda g: next(v for v in order if (g["verdict"] == v).any() or v == "not covered"))
    print("    cell verdicts:", verdicts.value_counts().to_dict())
    by_algorithm = pd.DataFrame({"algorithm": cells["algorithm"].first(), "epsilon": cells["epsilon"].first(),
                                 "verdict": verdicts}).sort_values(["algorithm", "epsilon"])
    for algorithm, group in by_algorithm.groupby("algorithm", sort=False):
        print(f"    {algorithm}: " + ", ".join(f"ε = {e:g} {v}" for e, v in zip(group["epsilon"], group["verdict"])))

    grid = select(load_grid_file(Path("experiments.yaml")), ["audit"])[0]
    spec = (grid.audit or AuditSpec()).model_copy(update={"control": None})
    dp_cells = [cell for cell in expand(grid)
                if cell.algorithm.name == "dp_sgd" and cell.epsilon is not None and cell.epsilon <= 1]
    start = time.perf_counter()
    print("2.  DP-SGD with the noise removed, every dp_sgd cell of `audit` at ε ≤ 1:")
    for cell in dp_cells:
        rows = audit_cell(cell, spec, algorithm=cell.make_algorithm().with_noise_scale(0.0))
        white = [r for r in rows if r["threat_model"].startswith("white-box") and r["status"] == "ok"]
        best = max(white, key=lambda r: r["epsilon_lo"])
        print(f"    ε = {cell.epsilon:g}: ε_lo = {best['epsilon_lo']:.3f} ({best['threat_model']}, verdict "
              f"{best['verdict']}; ceiling {best['ceiling']:.3f})")
    print(f"    ({time.perf_counter() - start:.0f} s)")

    rng = np.random.default_rng(7)
    cells_n, rows_n, n, eps, p0 = 2000, 3, 500, 1.0, 0.2
    tp, fp = rng.binomial(n, np.exp(eps) * p0, (cells_n, rows_n)), rng.binomial(n, p0, (cells_n, rows_n))
    lo = stats.epsilon_from_counts(tp, fp, n, n, 0.05 / rows_n, 0.0)
    print(f"3a. false refutations of an exactly tight ε = 1 mechanism, fixed threshold, families of {rows_n} rows "
          f"at 95%: {(lo > eps).any(axis=1).mean():.4f} of {cells_n} cells (stated α = 0.05)")
    rng = np.random.default_rng(4)
    cells_n, delta = 1000, 1e-5
    ranks = stats.order_ranks(n, n, eps, delta, 0.05)
    level = 0.05 / ranks.size
    out, u = rng.random((cells_n, n)), rng.random((cells_n, n))
    inn = np.where(u < delta, 2.0, 1.0 - (u - delta) / np.exp(eps))  # P[in > t] = min(1, e^ε P[out > t] + δ)
    top = -np.sort(-out, axis=1)
    rejected = np.array([[stats.order_p_value(int((inn[c] > top[c, j - 1]).sum()), n, int(j), n, eps, delta,
                                              level)[0] <= level for j in ranks] for c in range(cells_n)])
    print(f"3b. the same with the rule order (ranks {ranks.tolist()} from the claim, δ = 1e-5), tight at every "
          f"threshold: {rejected.any(axis=1).mean():.4f} of {cells_n} cells at a stated 95% (per rank "
          f"{np.round(rejected.mean(axis=0), 4).tolist()} at level {level:.4f} each)")

    power = results / "audit_power" / "audit.csv"
    if power.exists():
        p = pd.read_csv(power)
        p = p[(p["status"] == "ok") & p["epsilon_lo"].notna()]
        print("4.  one full-batch DP-SGD step (audit_power), best covered row per cell:")
        for _eps_target, group in p.groupby("epsilon"):
            best = group.loc[group["epsilon_lo"].idxmax()]
            claim = best["epsilon_claimed"]
            print(f"    ε = {claim:.3f}: ε_lo = {best['epsilon_lo']:.3f} = {best['epsilon_lo'] / claim:.2f}·ε "
                  f"(goal 0.65·ε: {'met' if best['epsilon_lo'] >= 0.65 * claim else 'NOT met'}); GDP estimate "
                  f"{best['gdp_epsilon']:.3f} = {best['gdp_epsilon'] / claim:.2f}·ε (goal 0.75·ε: "
                  f"{'met' if best['gdp_epsilon'] >= 0.75 * claim else 'NOT met'}); {best['canary']}, "
                  f"{best['threshold']}, family {best['family_size']:g}, {best['trials']:g} trials")
    else:
        print(f"4.  {power} missing: run dpsgd audit experiments.yaml --only audit_power --out {results}")

    one_run = spec.model_copy(update={"canaries": ["dirac"], "statistic": "one_run", "m_canaries": 100,
                                      "trials": 10, "chunk": 10, "control": grid.audit.control if grid.audit else 0.1})
    start = time.perf_counter()
    print("5.  one run (Steinke et al.), 100 Dirac canaries x 10 trainings pooled, dp_sgd cells of `audit`:")
    for cell in dp_cells:
        rows = audit_cell(cell, one_run)
        noiseless = audit_cell(cell, one_run.model_copy(update={"control": None}),
                               algorithm=cell.make_algorithm().with_noise_scale(0.0))
        print(f"    ε = {cell.epsilon:g}: ε_lo = " + " / ".join(f"{r['epsilon_lo']:.3f}" for r in rows)
              + " (last iterate / all iterates); twin (ε = " + f"{rows[0]['control_epsilon']:.3g}) "
              + " / ".join(f"{r['control_epsilon_lo']:.3f}" for r in rows) + f", verdict {rows[1]['verdict']}; "
              + "noise removed " + " / ".join(f"{r['epsilon_lo']:.3f}" for r in noiseless)
              + f", {noiseless[1]['verdict']}")
    print(f"    ({time.perf_counter() - start:.0f} s)")


def one_run_and_step() -> None:
    delta = 1e-5
    power = select(load_grid_file(Path("experiments.yaml")), ["audit_power"])[0]
    cells = {cell.epsilon: cell for cell in expand(power.model_copy(update={"epsilon": [1.0, 2.0, 4.0],
                                                                              "delta": delta}))}
    spec = AuditSpec(canaries=["dirac"], statistic="one_run", m_canaries=10_000, trials=1, chunk=1, ladder=[])
    start = time.perf_counter()
    row = audit_cell(cells[4.0], spec)[1]  # all iterates (at T = 1 the same test as the last iterate)
    seconds = time.perf_counter() - start
    claim, lo, gdp, twin = row["epsilon_claimed"], row["epsilon_lo"], row["epsilon_lo_gdp"], row["control_epsilon_lo"]
    print(f"6.  one run, 10^4 Dirac canaries in one training of one full-batch DP-SGD step, ε = {claim:.3f}, "
          f"δ = 1e-5 (goal: ε_lo ≥ 0.45·ε by the f-DP statistic): ε_lo (f-DP, (ε, δ) curve: the verdict's) = "
          f"{lo:.3f} = {lo / claim:.2f}·ε ({'met' if lo >= 0.45 * claim else 'NOT met'}); f-DP, μ-GDP curve "
          f"(valid for this Gaussian step) {gdp:.3f} = {gdp / claim:.2f}·ε "
          f"({'met' if gdp >= 0.45 * claim else 'NOT met'}); Steinke et al. {row['epsilon_lo_steinke']:.3f} = "
          f"{row['epsilon_lo_steinke'] / claim:.2f}·ε; twin (ε = {row['control_epsilon']:.0f}) from its own "
          f"training {twin:.3f} (Steinke et al. {row['control_epsilon_lo_steinke']:.3f}, μ-GDP "
          f"{row['control_epsilon_lo_gdp']:.3f}): {'refuted' if twin > claim else 'NOT refuted'}, verdict "
          f"{row['verdict']}; {seconds:.0f} s for both trainings (goal ≤ 120 s)")
    # one step's scores are b + σz exactly (section 7 checks it on the real ones): the spread of one draw, afresh
    rng, m, draws = np.random.default_rng([4, 2026]), spec.m_canaries, 25
    fresh = []
    for _ in range(draws):
        included = rng.random(m) < 0.5
        s = included + row["sigma"] * rng.standard_normal(m)
        fresh.append([stats.epsilon_one_run_fdp(s[included], s[~included], row["row_confidence"], delta, curve)
                      for curve in ("dp", "gdp")])
    for name, bounds in zip(("ε_lo, (ε, δ) curve", "μ-GDP curve"), np.array(fresh).T / claim):
        print(f"    {name} over {draws} fresh draws: median {np.median(bounds):.2f}·ε, quartiles "
              f"{np.percentile(bounds, 25):.2f}–{np.percentile(bounds, 75):.2f}, range {bounds.min():.2f}–"
              f"{bounds.max():.2f}; ≥ 0.45·ε in {np.mean(bounds >= 0.45):.0%} of draws")
    grid = select(load_grid_file(Path("experiments.yaml")), ["audit"])[0]
    chain = next(c for c in expand(grid) if c.algorithm.name == "dp_sgd" and c.epsilon == 4)
    start = time.perf_counter()
    rows = audit_cell(chain, spec)
    seconds = time.perf_counter() - start
    print(f"6b. the same on the `audit` grid's dp_sgd cell at ε = {rows[0]['epsilon_claimed']:.3f}, δ = "
          f"{rows[0]['delta']:g} (Poisson-subsampled, T = {rows[0]['steps']}, σ = {rows[0]['sigma']:.3f} with the "
          f"canary rows; the μ-GDP curve not valid here), ε_lo / Steinke et al. / μ-GDP, and the twin's:")
    for r in rows:
        print(f"    {r['threat_model']}: {r['epsilon_lo']:.3f} / {r['epsilon_lo_steinke']:.3f} / "
              f"{r['epsilon_lo_gdp']:.3f}; twin (ε = {r['control_epsilon']:,.0f}) {r['control_epsilon_lo']:.3f} / "
              f"{r['control_epsilon_lo_steinke']:.3f} / {r['control_epsilon_lo_gdp']:.3f} "
              f"({'refuted' if r['control_epsilon_lo'] > r['epsilon_claimed'] else 'NOT refuted'}); verdict "
              f"{r['verdict']}: {r['reason']}")
    print(f"    ({seconds:.0f} s for both trainings)")

    trials, draws = 200_000, 25
    print(f"7.  one full-batch step, δ = 1e-5, rule order, 2 x {trials:,} trials (goal: median ε_lo ≥ 0.65·ε, "
          "≤ 5 minutes):")
    for epsilon, cell in cells.items():
        start = time.perf_counter()
        scores: dict = {}
        row = audit_cell(cell, power.audit.model_copy(update={"trials": trials, "control": None}),
                         scores=scores)[1]
        seconds = time.perf_counter() - start
        claim, sigma = row["epsilon_claimed"], row["sigma"]
        s_in, s_out = (scores[f"dirac.white-box_all_iterates.{w}"] for w in ("in", "out"))
        # the step's statistic is b + σz exactly: its law checked on the real scores, then drawn afresh
        fit = min(scipy.stats.kstest(s_in, "norm", args=(1.0, sigma)).pvalue,
                  scipy.stats.kstest(s_out, "norm", args=(0.0, sigma)).pvalue)
        rng = np.random.default_rng([int(epsilon), 2026])
        fresh = np.array([stats.epsilon_clopper_pearson(1.0 + sigma * rng.standard_normal(trials),
                                                        sigma * rng.standard_normal(trials), row["row_confidence"],
                                                        delta, "order", claim=claim) for _ in range(draws)]) / claim
        print(f"    ε = {claim:.3f}: the real audit {row['epsilon_lo']:.3f} = {row['epsilon_lo'] / claim:.2f}·ε in "
              f"{seconds:.0f} s (scores vs N(b, σ²): KS p ≥ {fit:.2f}); {draws} fresh draws: median "
              f"{np.median(fresh):.2f}·ε, quartiles {np.percentile(fresh, 25):.2f}–{np.percentile(fresh, 75):.2f}, "
              f"range {fresh.min():.2f}–{fresh.max():.2f} (goal: "
              f"{'met' if np.median(fresh) >= 0.65 and seconds <= 300 else 'NOT met'})")



LADDER_GOAL = ("noise_half", "no_clip")  # refuted with the default trials on dp_sgd at ε ≤ 1 and on adult


def ladder_goals(results: Path) -> None:
    """8. Which controls of the ladder the default audit refutes (best covered row per control)."""
    from dpsgd_cli.audit import controls
    from dpsgd_cli.audit.engine import audit_cell
    from dpsgd_cli.config import AuditSpec

    frame = pd.read_csv(results / "audit" / "audit.csv")
    ok = frame[(frame["status"] == "ok") & (frame["verdict"] != "not covered")]
    dp = ok[(ok["algorithm"] == "dp_sgd") & (ok["epsilon"] <= 1)]
    adult = adult_cell(1.0)
    start = time.perf_counter()
    adult_rows = pd.DataFrame(audit_cell(adult, AuditSpec(chunk=500)))
    seconds = time.perf_counter() - start
    adult_rows = adult_rows[(adult_rows["status"] == "ok") & (adult_rows["verdict"] != "not covered")]
    print("8.  the ladder of controls, best covered row per control (ε_lo > ε: refuted; the default audit: trials "
          "a world chosen per cell and control, the most a row of each has):")
    met = True
    for name, group in [*((f"audit, dp_sgd ε = {e:g}", g) for e, g in dp.groupby("epsilon")),
                        (f"adult 3,000 records, B = 64, 3 epochs, dp_sgd ε = 1 ({seconds:.0f} s)", adult_rows)]:
        claim = float(group["epsilon_claimed"].iloc[0])
        found = {o.label: o for o in controls.outcomes(group.to_dict("records"))}
        parts = []
        for key in ("sigma_t10", "noise_half", "control", "no_clip"):
            label = controls.LABELS.get(key) or f"noise × {group['control'].iloc[0]:g}"
            o = found.get(label)
            if o is None:
                parts.append(f"{label}: n/a")
                continue
            trials = int(group[f"{key}_trials"].max()) if f"{key}_trials" in group else None
            parts.append(f"{label} (ε = {'∞' if np.isinf(o.epsilon) else f'{o.epsilon:.3g}'}): ε_lo "
                         f"{o.epsilon_lo:.3f} {'REFUTED' if o.caught else 'not refuted'}"
                         + (f" at {trials:,} trials" if trials else ""))
            met &= o.caught or key not in LADDER_GOAL
        verdict = "refuted" if (group["verdict"] == "refuted").any() else ", ".join(sorted(set(group["verdict"])))
        print(f"    {name}: claimed {claim:.3f}, sound ε_lo {group['epsilon_lo'].max():.3f} ({verdict}, "
              f"{int(group['trials'].max()):,} trials); "
              + "; ".join(parts))
    print(f"    goal (noise × 0.5 and no clipping refuted in every one): {'met' if met else 'NOT met'}")
    sound = ok[ok["verdict"] == "refuted"]
    print(f"    sound algorithms refuted on `audit`: {len(sound)} rows"
          + (": " + ", ".join(f"{r.algorithm} ε = {r.epsilon:g}" for r in sound.itertuples()) if len(sound) else ""))


def half_noise_curve(trials: tuple[int, ...] = (1000, 4000, 8000, 16000, 32000)) -> None:
    """8b. ε_lo of the noise × 0.5 control over the trials a world, on the `audit` grid's dp_sgd cells at ε ≤ 1
    (Dirac canary, the grid's audit otherwise; the sound cell's ε_lo beside it)."""
    from dpsgd_cli.audit.engine import audit_cell
    from dpsgd_cli.config import AuditSpec, expand, load_grid_file, select

    grid = select(load_grid_file(Path("experiments.yaml")), ["audit"])[0]
    spec = (grid.audit or AuditSpec()).model_copy(update={"canaries": ["dirac"], "ladder": ["noise_half"]})
    print("8b. noise × 0.5 over the trials a world (dp_sgd, `audit` grid, Dirac canary; best row, sound ε_lo "
          "beside):")
    for cell in expand(grid):
        if cell.algorithm.name != "dp_sgd" or cell.epsilon is None or cell.epsilon > 1:
            continue
        for n in trials:
            start = time.perf_counter()
            rows = audit_cell(cell, spec.model_copy(update={"trials": n, "chunk": min(n, 1000)}))
            best = max(rows, key=lambda r: r["noise_half_epsilon_lo"])
            print(f"    ε = {cell.epsilon:g}, {n} trials: noise × 0.5 (ε = {best['noise_half_epsilon']:.3g}) ε_lo = "
                  f"{best['noise_half_epsilon_lo']:.3f} ({best['threat_model']}; ceiling {best['ceiling']:.2f}); "
                  f"sound {max(r['epsilon_lo'] for r in rows):.3f}; {time.perf_counter() - start:.0f} s")


def adult_cell(epsilon: float, accountant: str | None = None):
    """The adult cell of the ladder goals (3,000 records, B = 64, 3 epochs, δ = 1e-5) at `epsilon`; `accountant`
    replaces dp_sgd's own (RDP)."""
    algorithm = {"name": "dp_sgd", **({"accountant": accountant} if accountant else {})}
    return expand(GridFile.model_validate({"grids": [{
        "name": "ladder_adult", "datasets": [{"name": "adult", "subsample": 3000}], "models": ["logreg"],
        "algorithms": [algorithm], "epsilon": [epsilon], "delta": 1e-5, "batch_size": [64], "epochs": 3, "lr": [0.5],
        "l2": 1e-3, "clip_norm": 1.0, "seeds": 1}]}).grids[0])[0]


def all_iterates_scores(rng: np.random.Generator, n: int, steps: int, sigma: float, q: float,
                        included: bool) -> np.ndarray:
    """n fresh all-iterates Dirac scores of a Poisson-subsampled Gaussian chain from their exact law: the step
    statistics x_t = b_t + σz_t (b_t ~ Bernoulli(q) with the canary, 0 without), scored as the audit scores them."""
    out = np.empty(n)
    for start in range(0, n, 10_000):  # 10⁴ replicas × T steps at a time: memory stays ~10 MB per 100 steps
        m = min(10_000, n - start)
        x = sigma * rng.standard_normal((steps, m))
        if included:
            x += rng.random((steps, m)) < q
        out[start:start + m] = canaries.step_likelihood_ratio(x, sigma, q)
    return out


FULL_TRAINING_FAMILY = 2  # the Dirac canary's two rows on a subsampled chain are two tests (docs/audit.md)


def full_training(trials: tuple[int, ...] = (2000, 5000, 10_000, 20_000), draws: int = 25,
                  fresh_trials: tuple[int, ...] = (20_000, 100_000),
                  expected_trials: tuple[int, ...] = (2000, 20_000, 100_000, 10**6, 10**7)) -> None:
    """9. Full training, white box, all iterates: dp_sgd on adult at ε = 2 and 4, ε_lo over the trials a world
    (goal: ≥ 0.5·ε with ≤ 2 × 2·10⁴ trials in ≤ 10 minutes), and what bounds it; then the same where the claim is
    the mechanism's exact ε (σ calibrated by the PLD accountant), at the most trials only."""
    row_confidence = stats.family_confidence(0.95, FULL_TRAINING_FAMILY)
    print("9.  full training, white box, all iterates: dp_sgd on adult (3,000 records, B = 64, 3 epochs), "
          "δ = 1e-5, Dirac canary, rule order (goal: ε_lo ≥ 0.5·ε with ≤ 2 × 20,000 trials, ≤ 10 minutes); then "
          "with σ calibrated by the PLD accountant (the claim the mechanism's exact ε), at the most trials:")
    for accountant in (None, "pld"):
        for epsilon in (2.0, 4.0):
            cell = adult_cell(epsilon, accountant)
            scores: dict = {}
            for n in trials if accountant is None else trials[-1:]:
                spec = AuditSpec(canaries=["dirac"], control=None, ladder=[], trials=n, chunk=min(n, 1000))
                wall, cpu = time.perf_counter(), time.process_time()
                last, every = audit_cell(cell, spec, scores=scores)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                assert every["family_size"] == FULL_TRAINING_FAMILY
                claim = every["epsilon_claimed"]
                print(f"    ε = {claim:.3f} ({accountant or 'rdp'}), "
                      f"{n:,} trials: ε_lo = {every['epsilon_lo']:.3f} = {every['epsilon_lo'] / claim:.2f}·ε all "
                      f"iterates ({last['epsilon_lo']:.3f} last; ceiling {every['ceiling']:.2f}, AUC "
                      f"{every['auc']:.3f}); {wall:.0f} s wall, {cpu:.0f} s CPU, load {os.getloadavg()[0]:.1f}")
            measured = (tuple(scores[f"dirac.white-box_all_iterates.{w}"] for w in ("in", "out")) if scores
                        else None)
            full_training_bound(cell, row_confidence, draws, fresh_trials if accountant is None else fresh_trials[:1],
                                expected_trials, measured)


def full_training_bound(cell, row_confidence: float, draws: int, fresh_trials: tuple[int, ...],
                        expected_trials: tuple[int, ...],
                        measured: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """What the all-iterates Dirac audit of `cell` can reach: the tool's ε_lo over fresh draws of the exact scores,
    and at the expected counts of the most powerful test (the mechanism's PLD trade-off curve, which this canary's
    likelihood ratio attains: the worlds are the subsampled Gaussian's dominating pair) the tool's rule, the best
    single rank fixed in advance at the row's whole α, and ln((TPR − δ)/FPR) itself at FPR ≥ 1/N. `measured`: the
    real audit's all-iterates scores (in, out), compared with the exact law (two-sample Kolmogorov–Smirnov)."""
    delta = 1e-5
    # the mechanism as the audit runs it (the canary row included)
    algorithm, data = cell.make_algorithm(), dataset(cell.dataset, cell.validation)
    model, setting, _, X, y = dirac_setup(cell, data)
    prepared = algorithm.prepare(setting, model, X, y, ReplicaStreams(range(1)))
    derived = prepared.finish(prepared.theta).derived
    sigma, q, steps, claim = derived["sigma"], derived["sample_rate"], derived["steps"], derived["epsilon_achieved"]
    profile, _ = risk.privacy_profile(algorithm.dp_event(setting, derived), "add_remove", claim)
    exact = float(np.interp(delta, profile[::-1], risk.EPSILON_GRID[::-1]))  # δ(ε) decreases
    print(f"    bound at ε = {claim:.3f} ({derived['accountant']} accountant; σ = {sigma:.4f}, q = {q:.4f}, T = "
          f"{steps}): the exact (PLD) ε at δ = 1e-5 is {exact:.3f} = {exact / claim:.2f}·ε, above which no ε_lo "
          "converges")
    if measured is not None:
        rng = np.random.default_rng([int(claim), 52])
        fit = min(scipy.stats.ks_2samp(real, all_iterates_scores(rng, 100_000, steps, sigma, q, world == "in")).pvalue
                  for real, world in zip(measured, ("in", "out")))
        print(f"    the real audit's scores against the exact law: Kolmogorov–Smirnov p ≥ {fit:.2f} (in and out)")

    def power(fpr: float) -> float:
        return risk.tpr_bound(fpr, risk.EPSILON_GRID, profile)

    alpha = 1 - row_confidence

    def expected(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ranks j, the most powerful test's expected counts there, and the exact test's ε_lo at the row's α."""
        j = np.unique(np.round(np.geomspace(1, n // 2, 40)).astype(int))
        k = np.floor(np.array([power(r / (n + 1)) for r in j]) * n).astype(int)
        return j, k, np.array([stats.epsilon_order(int(a), n, int(b), n, alpha, delta) for a, b in zip(k, j)])

    if draws:  # the ratio against the simpler scores of the same step statistics, on the same draws
        rng = np.random.default_rng([int(claim), 7])
        by_score: dict[str, list[float]] = {"the likelihood ratio": [], "Σ_t x_t": [], "max_t x_t": []}
        for _ in range(7):
            x_in = sigma * rng.standard_normal((steps, fresh_trials[0])) + (rng.random((steps, fresh_trials[0])) < q)
            x_out = sigma * rng.standard_normal((steps, fresh_trials[0]))
            for name, score in zip(by_score, (lambda x: canaries.step_likelihood_ratio(x, sigma, q),
                                              lambda x: x.sum(axis=0), lambda x: x.max(axis=0))):
                by_score[name].append(stats.epsilon_clopper_pearson(score(x_in), score(x_out), row_confidence, delta,
                                                                    "order", claim=claim) / claim)
        print(f"    7 fresh draws, {fresh_trials[0]:,} trials, the tool's rule's median by score: "
              + ", ".join(f"{name} {np.median(v):.2f}·ε" for name, v in by_score.items()))
    rng = np.random.default_rng([int(claim), 51])
    for n in fresh_trials:
        j, _, bounds = expected(n)
        best_rank = int(j[int(np.argmax(bounds))])  # the oracle's one rank, fixed from the exact curve
        fresh = []
        for _ in range(draws):
            s_in, s_out = (all_iterates_scores(rng, n, steps, sigma, q, world) for world in (True, False))
            above = int((s_in > np.sort(s_out)[::-1][best_rank - 1]).sum())
            fresh.append((stats.epsilon_clopper_pearson(s_in, s_out, row_confidence, delta, "order", claim=claim),
                          stats.epsilon_order(above, n, best_rank, n, alpha, delta)))
        for name, bound in zip(("the tool's rule", f"the oracle's rank {best_rank} at the whole α"),
                               np.array(fresh).T / claim):
            print(f"    {draws} fresh draws of the exact scores, {n:,} trials, {name}: ε_lo median "
                  f"{np.median(bound):.2f}·ε, quartiles {np.percentile(bound, 25):.2f}–{np.percentile(bound, 75):.2f}, "
                  f"range {bound.min():.2f}–{bound.max():.2f}, ≥ 0.5·ε in {np.mean(bound >= 0.5):.0%}")
    for n in expected_trials:
        j, k, bounds = expected(n)
        point = float(np.max(np.log(np.maximum(k / n - delta, 1e-300) / (j / (n + 1)))))
        ranks = stats.order_ranks(n, n, claim, delta, alpha)
        tool = max(stats.epsilon_order(int(np.floor(power(r / (n + 1)) * n)), n, int(r), n, alpha / ranks.size,
                                       delta) for r in ranks)
        print(f"    expected counts of the most powerful test, {n:,} trials: the tool's rule {tool / claim:.2f}·ε, "
              f"the best single rank {bounds.max() / claim:.2f}·ε, ln((TPR − δ)/FPR) at FPR ≥ 1/N "
              f"{point / claim:.2f}·ε")
    need = stats.trials_to_refute(power, 0.5 * claim, row_confidence, delta, limit=10**7)
    print("    trials a world the tool's rule needs to refute 0.5·ε at those counts: "
          + ("more than 10^7" if need is None else f"{need:,}"))


if __name__ == "__main__":
    if sys.argv[1:] == ["--one-run-and-step"]:
        one_run_and_step()
    elif sys.argv[1:] == ["--full-training"]:
        full_training()
    else:
        folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results")
        main(folder)
        ladder_goals(folder)
        half_noise_curve()
        one_run_and_step()
        full_training()
