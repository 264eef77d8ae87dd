"""`bassily2014`: closed forms against hand computations, the accountants, noise, projection, replicas, engine."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms.bassily import Bassily2014
from dpsgd_cli.algorithms.ops import constant
from dpsgd_cli.algorithms.sampling import uniform_examples
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy.single_example_gaussian import (
    calibrate_bassily,
    chain_bound,
    closed_form_sigma,
    pld_event,
    rdp_epsilon,
    rdp_event,
)


@pytest.fixture(scope="module")
def data(make_logistic_data):
    return make_logistic_data(3, 200, [1.0, -2.0, 0.5, 0.0, 1.0], 0.2)


def _setting(X, **kw):
    base = dict(n=X.shape[0], d=X.shape[1], delta=1e-5, l2=1e-2, epsilon=1.0, epochs=1.0)
    return Setting(**{**base, **kw})


# ---------------------------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------------------------


def test_closed_forms_by_hand():
    # n = 100, T = 500, δ = 1e-4, ε = 0.5, l = 1:
    # paper:   √32 · √(500 · ln(5e4) · ln(1e4)) / 50 = 5.656854 · √(500 · 10.819778 · 9.210340) / 50 = 25.2544
    # lecture: 16 · √(500 · ln(2e4) · ln(1.25e5)) / 50 = 16 · √(500 · 9.903488 · 11.736069) / 50 = 77.1419
    assert closed_form_sigma(0.5, 1e-4, 100, 500, 1.0, "paper") == pytest.approx(25.254397256555258, rel=1e-12)
    assert closed_form_sigma(0.5, 1e-4, 100, 500, 1.0, "lecture") == pytest.approx(77.14191005559861, rel=1e-12)
    # σ scales with l and 1/ε
    assert closed_form_sigma(0.25, 1e-4, 100, 500, 2.0, "paper") == pytest.approx(4 * 25.254397256555258)


def test_paper_closed_form_at_t_equal_n_squared_is_the_papers_sigma_over_n():
    # BST14 Alg. 1: σ_P² = 32 L² n² log(n/δ) log(1/δ) / ε² on the sum scale; noise on ∇ℓ of the mean is σ_P / n
    n, delta, eps, L = 300, 1e-6, 0.7, 1.5
    sigma_paper = math.sqrt(32 * L**2 * n**2 * math.log(n / delta) * math.log(1 / delta) / eps**2)
    assert closed_form_sigma(eps, delta, n, n * n, L, "paper") == pytest.approx(sigma_paper / n, rel=1e-12)


def test_chain_bound_by_hand():
    # σ = 20, n = 100, T = 500, δ = 1e-4, l = 1: δ₀ = nδ/(2T) = 1e-5, ε₀ = 2√(2 ln(1.25e5))/20 = 0.484481,
    # 2qε₀ = 0.009690, total = ε₁√(2T ln(2/δ)) + Tε₁(e^ε₁ − 1) = 1.011446
    b = chain_bound(20.0, 1e-4, 100, 500, 1.0, amplification="approx", gaussian="classical")
    assert b.delta0 == pytest.approx(1e-5)
    assert b.eps0 == pytest.approx(0.4844805262605389, rel=1e-12)
    assert b.eps1 == pytest.approx(0.009689610525210777, rel=1e-12)
    assert b.epsilon == pytest.approx(1.0114463240071243, rel=1e-12) and b.valid
    tight = chain_bound(20.0, 1e-4, 100, 500, 1.0, amplification="tight", gaussian="classical")
    assert tight.eps1 == pytest.approx(math.log1p(0.01 * math.expm1(b.eps0)), rel=1e-12)
    assert tight.epsilon < b.epsilon
    big = chain_bound(0.5, 1e-4, 100, 500, 1.0, amplification="approx", gaussian="classical")
    assert not big.valid and "ε₀" in big.reason


@pytest.mark.parametrize("amplification", ["tight", "approx"])
def test_advanced_composition_calibration_hits_the_target(amplification):
    n, T, delta, eps = 1000, 20000, 1e-6, 0.5
    p = calibrate_bassily(eps, delta, n, T, 1.0, "advanced_composition", amplification=amplification)
    assert 0.999 * eps <= p.epsilon <= eps
    gaussian = "analytic" if amplification == "tight" else "classical"
    assert chain_bound(p.sigma, delta, n, T, 1.0, amplification, gaussian).epsilon == pytest.approx(p.epsilon)
    assert p.accountant == f"advanced_composition_{amplification}"
    if amplification == "approx":  # here ε₀ ≤ 1: the lecture's chain is valid, and looser than the tight one
        assert p.proved and p.details["eps0"] <= 1
        tight = calibrate_bassily(eps, delta, n, T, 1.0, "advanced_composition", amplification="tight")
        assert p.sigma > tight.sigma


def test_approx_amplification_is_flagged_when_eps0_exceeds_one():
    p = calibrate_bassily(3.0, 1e-6, 1000, 5000, 1.0, "advanced_composition", amplification="approx")
    assert not p.proved and "ε₀" in p.reason and p.details["eps0"] > 1


def test_closed_form_guarantee_conditions():
    n = 100
    at_n2 = calibrate_bassily(1.0, 1 / n**2, n, n * n, 1.0, "closed_form", "paper")
    assert at_n2.proved and at_n2.epsilon == 1.0 and at_n2.details["epsilon_chain"] <= 1.0
    few_steps = calibrate_bassily(1.0, 1 / n**2, n, 5 * n, 1.0, "closed_form", "paper")  # ε₀ < 1, chain > ε
    assert not few_steps.proved and "certify only" in few_steps.reason
    assert calibrate_bassily(1.0, 1 / n**2, n, 5 * n, 1.0, "closed_form", "lecture").proved
    big_n = calibrate_bassily(1.0, 1e-8, 10**4, 5 * 10**4, 1.0, "closed_form", "lecture")  # adult-like: ε₀ ≈ 2
    assert not big_n.proved and "ε₀" in big_n.reason and big_n.details["eps0"] > 1
    large_eps = calibrate_bassily(3.0, 1 / n**2, n, n * n, 1.0, "closed_form", "lecture")
    assert not large_eps.proved and "epsilon = 3 > 1" in large_eps.reason


@pytest.mark.parametrize("accounting", ["rdp", "pld"])
def test_accountants_calibrate_within_the_window(accounting):
    n, T, delta = 500, 1500, 1e-6
    p = calibrate_bassily(1.0, delta, n, T, 1.0, accounting)
    assert 0.999 <= p.epsilon <= 1.0 and p.accountant == accounting
    assert p.sigma == pytest.approx(2.0 * p.details["noise_multiplier"])  # σ = 2l · noise multiplier
    if accounting == "rdp":
        assert rdp_epsilon(p.details["noise_multiplier"], n, T, delta)[0] == pytest.approx(p.epsilon)


def test_rdp_is_the_librarys_sampled_without_replacement_bound():
    from dp_accounting.privacy_accountant import NeighboringRelation
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    orders = [1.5, 2, 3, 4, 8, 16, 32, 64]
    ours = rdp_epsilon(2.0, 200, 400, 1e-5)[0]
    acc = RdpAccountant(orders, NeighboringRelation.REPLACE_ONE)
    acc.compose(rdp_event(2.0, 200, 400))
    assert ours <= acc.get_epsilon(1e-5) + 1e-12  # our grid contains these orders (and more)
    assert ours == pytest.approx(acc.get_epsilon(1e-5), rel=0.05)


def test_pld_pair_dominates_one_step_of_the_mechanism():
    """One step releases g_I + N(0, σ²) with I uniform over n records, ‖g‖ ≤ l; neighbours replace one record.
    In 1-D, against many configurations (others duplicating z or z', centred, spread), both orders: the hockey-stick
    divergence never exceeds that of the PLD pair; and the naive pair with shifts ±l (half ours) fails."""
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.privacy_accountant import NeighboringRelation

    n, sigma, lip = 4, 1.0, 1.0
    x = np.linspace(-12, 12, 24001)
    dx = x[1] - x[0]
    pdf = {c: stats.norm.pdf(x, c, sigma) for c in (-lip, 0.0, lip)}

    def mix(centres):
        return sum(pdf[c] for c in centres) / len(centres)

    def hockey(p, q, eps):
        return np.sum(np.maximum(p - math.exp(eps) * q, 0.0)) * dx

    def pair(multiplier):  # pessimistic PLD of the pair: its δ(ε) is an upper estimate
        acc = PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-3)
        acc.compose(pld_event(multiplier, n, 1))
        return acc

    ours, naive = pair(sigma / (2 * lip)), pair(sigma / lip)

    configs = [(a, b, others) for a in (-lip, 0.0, lip) for b in (-lip, lip)
               for others in ([a] * 3, [b] * 3, [0.0] * 3, [-lip, 0.0, lip])]
    for eps in (0.0, 0.5, 1.0, 2.0):
        worst = max(max(hockey(mix([a, *o]), mix([b, *o]), eps), hockey(mix([b, *o]), mix([a, *o]), eps))
                    for a, b, o in configs)
        assert worst <= ours.get_delta(eps) + 1e-6
        if eps >= 0.5:
            assert worst > 2 * naive.get_delta(eps)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def test_noise_is_gaussian_with_std_sigma():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(100, 50)) / 10.0
    y = np.where(rng.random(100) < 0.5, 1.0, -1.0)
    model = make_model("logreg", X.shape[1], 0.0)
    setting, sigma, R = _setting(X, l2=0.0), 0.7, 400  # 400 replicas × 50 coordinates = 20000 draws
    streams = ReplicaStreams(range(R))
    algo = Bassily2014()
    noisy = algo.chain(setting, X, y, streams, model, sigma, 1.0, 1e9, constant(1.0))
    clean = algo.chain(setting, X, y, streams, model, 0.0, 1.0, 1e9, constant(1.0))
    theta0 = np.zeros((R, X.shape[1]))
    z = -(noisy.run(model, theta0, 1) - clean.run(model, theta0, 1)).ravel()  # one step, lr 1: exactly σ·N(0, I)
    n_z = z.size
    assert abs(z.mean()) < 4 * sigma / math.sqrt(n_z)
    for scale, ok in ((1.0, True), (1.05, False), (0.95, False)):
        chi2 = np.sum(z**2) / (scale * sigma) ** 2
        p = 2 * min(stats.chi2.cdf(chi2, n_z), stats.chi2.sf(chi2, n_z))
        assert (p > 1e-3) == ok, (scale, p)


def test_projection_keeps_iterates_in_the_ball(data):
    X, y = data
    model = make_model("logreg", X.shape[1], 0.0)
    algo, radius = Bassily2014(), 0.05
    chain = algo.chain(_setting(X, l2=0.0), X, y, ReplicaStreams([0, 1, 2]), model, 2.0, 1.0, radius, constant(0.5))
    theta, on_boundary = np.zeros((3, X.shape[1])), 0
    for _ in range(100):
        theta = chain.run(model, theta, 1)
        norms = np.linalg.norm(theta, axis=1)
        assert np.all(norms <= radius * (1 + 1e-12))
        on_boundary += int(np.isclose(norms, radius).sum())
    assert on_boundary > 100  # the projection was active


def test_without_noise_it_is_projected_sgd(data):
    """σ = 0: the chain equals a plain loop of projected SGD on F with the same examples and steps."""
    X, y = data
    lam, radius, c, steps, seeds = 1e-2, 0.8, 0.5, 300, [5, 6]
    model = make_model("logreg", X.shape[1], lam)
    chain = Bassily2014().chain(_setting(X, l2=lam), X, y, ReplicaStreams(seeds), model, 0.0, 1.0, radius,
                                lambda t: c / math.sqrt(t))
    got = chain.run(model, np.zeros((2, X.shape[1])), steps)
    batches = uniform_examples(X, y, ReplicaStreams(seeds), 1)
    ref = np.zeros((2, X.shape[1]))
    for t in range(1, steps + 1):
        b = next(batches)
        x, yy = b.X[:, 0, :], b.y[:, 0]
        grad = (-yy / (1 + np.exp(yy * np.sum(x * ref, axis=1))))[:, None] * x + lam * ref  # ‖∇ℓ‖ ≤ 1: no clip
        ref = ref - c / math.sqrt(t) * grad
        ref = ref * np.minimum(1.0, radius / np.linalg.norm(ref, axis=1, keepdims=True))
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("params", [{"accounting": "rdp"}, {"accounting": "closed_form", "schedule": "convex"}])
def test_replicas_are_independent(data, params):
    X, y = data
    model = make_model("logreg", X.shape[1], 1e-2)
    algo = ALGORITHMS["bassily2014"](params)
    together = algo.fit(_setting(X), model, X, y, ReplicaStreams([0, 1, 2]))
    alone = algo.fit(_setting(X), model, X, y, ReplicaStreams([2]))
    np.testing.assert_allclose(together.theta[2], alone.theta[0], rtol=1e-12)
    assert not np.allclose(together.theta[0], together.theta[1])


def test_fit_derives_and_checks(data):
    X, y = data
    model = make_model("logreg", X.shape[1], 1e-2)
    out = Bassily2014({"accounting": "rdp"}).fit(_setting(X, epochs=2.0), model, X, y, ReplicaStreams([0]))
    d = out.derived
    assert d["steps"] == 400 and d["sample_rate"] == 1 / 200 and d["accountant"] == "rdp"
    assert d["radius"] == pytest.approx(100.0) and d["schedule"] == "1/(λt)" and d["sensitivity"] == 2.0
    assert 0.999 <= d["epsilon_achieved"] <= 1.0 and out.guarantee == "proved"
    convex = Bassily2014({"accounting": "closed_form", "schedule": "convex", "radius": 3.0})
    out = convex.fit(_setting(X, l2=0.0, epsilon=3.0), make_model("logreg", 5, 0.0), X, y, ReplicaStreams([0]))
    G = math.sqrt(5 * out.derived["sigma"] ** 2 + 1.0)
    assert out.derived["step_c"] == pytest.approx(2 * 3.0 / G)  # γ_t = ‖C‖₂/(G√t), ‖C‖₂ = 2R
    assert out.guarantee.startswith("none: epsilon = 3 > 1")
    assert out.derived["epsilon_rdp"] < out.derived["epsilon_achieved"]  # here the closed form over-noises
    wide = X * 2.0
    out = Bassily2014({"accounting": "rdp"}).fit(_setting(X), model, wide, y, ReplicaStreams([0]))
    assert out.guarantee.startswith("none: rows outside the unit ball")

    class NonConvex(type(model)):
        convex = False

    out = Bassily2014({"accounting": "rdp"}).fit(_setting(X), NonConvex(5, 1e-2), X, y, ReplicaStreams([0]))
    assert out.guarantee == "none: non-convex model"


def test_end_to_end_through_the_engine(run_grid):
    runs = run_grid("""
        grids:
          - name: bst
            datasets: [{name: synthetic, n: 600}]
            algorithms: [{name: bassily2014, accounting: rdp}, {name: bassily2014, accounting: advanced_composition}]
            epsilon: [1]
            l2: [0.01]
            seeds: 2
            epochs: 1
            trace_every: 100
    """)
    assert len(runs) == 4 and set(runs["status"]) == {"ok"} and set(runs["guarantee"]) == {"proved"}
    assert runs["batch_size"].isna().all() and runs["lr"].isna().all()
    assert set(runs["accountant"]) == {"rdp", "advanced_composition_tight"}
    assert (runs["sigma"] > 0).all() and (runs["steps"] == runs["n_train"]).all()
    assert ((runs["epsilon_achieved"] <= 1) & (runs["epsilon_achieved"] >= 0.999)).all()
    assert (runs["sample_rate"] == 1 / runs["n_train"]).all() and runs["test_accuracy"].notna().all()
    traces = pd.read_csv(run_grid.folder / "traces.csv")
    assert len(traces) == 4 * (runs["n_train"].iloc[0] // 100)


def test_noise_scale_table_holds_t_and_delta_fixed_over_n_and_marks_unproved_points(tmp_path):
    """Bellet's "more data (larger n) → less noise" is at fixed T and δ: the n panel keeps both; the lecture's
    closed form is the default formula; points whose lemmas do not apply are flagged (drawn hollow)."""
    from dpsgd_cli.config import FigureSpec
    from dpsgd_cli.engine.analytic import NOISE_ACCOUNTINGS, noise_scale_table
    from dpsgd_cli.plots import _noise_scale_figure

    keep = ["closed form (lecture, 16·l)", "advanced composition, 2qε"]
    skip = [label for label, *_ in NOISE_ACCOUNTINGS if label not in keep]
    table = noise_scale_table({"epsilon": 1.0, "n": 3000, "epochs": [1, 3], "n_values": [300, 1000, 3000],
                               "steps_fixed": 3000, "delta_fixed": 1e-7, "skip": skip})
    by_n = table[table["panel"] == "n"]
    assert set(by_n["steps"]) == {3000} and set(by_n["delta"]) == {1e-7}
    for _, line in by_n.groupby("accounting"):
        assert line["sigma"].is_monotonic_decreasing
    lecture = by_n[by_n["accounting"] == keep[0]].set_index("n")["sigma"]
    assert lecture[1000] == pytest.approx(closed_form_sigma(1.0, 1e-7, 1000, 3000, 1.0, "lecture"))
    assert closed_form_sigma(1.0, 1e-7, 1000, 3000, 1.0) == lecture[1000]  # the lecture's is the default
    assert table["proved"].any() and not table["proved"].all()
    fig = _noise_scale_figure(table, FigureSpec(name="n", kind="noise_scale"))
    hollow = [line for ax in fig.axes for line in ax.lines
              if line.get_markerfacecolor() in ("none", "white") and len(line.get_xdata())]
    assert sum(len(line.get_xdata()) for line in hollow) == (~table["proved"]).sum()
    labels = [line.get_label() for ax in fig.axes for line in ax.lines]
    assert any("hollow: not proved" in label for label in labels)  # the legend's entry (the figure's legend)


def test_formula_defaults_to_the_lecture_and_is_pinned_elsewhere():
    from dpsgd_cli.algorithms.bassily import BassilyParams

    assert BassilyParams().formula == "lecture"
    assert BassilyParams(accounting="pld").formula == "paper"  # does nothing there; keeps older run ids
    assert BassilyParams(accounting="pld", formula="lecture").formula == "lecture"
