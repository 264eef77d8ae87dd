"""`dpsgd audit`: the statistics against JAX Privacy and closed forms, sound algorithms not flagged, broken
DP-SGD variants caught, and the white-box audit's power (one step of DP-SGD is audited nearly tight)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats
from typer.testing import CliRunner

from dpsgd_cli.algorithms.ops import Clip, Noise, Op
from dpsgd_cli.algorithms.sgd import DPSGD
from dpsgd_cli.audit import stats
from dpsgd_cli.audit.engine import audit_cell
from dpsgd_cli.cli import app
from dpsgd_cli.config import AuditSpec, GridFile, expand
from dpsgd_cli.data import Dataset
from dpsgd_cli.engine.runner import dataset

REFERENCE = json.loads((Path(__file__).parent / "data" / "audit_reference.json").read_text())


def _reference_scores():
    import importlib.util

    spec = importlib.util.spec_from_file_location("audit_reference", Path(__file__).parent / "audit_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fixed_scores()


# --- statistics -----------------------------------------------------------------------------------------------

def test_clopper_pearson_matches_jax_privacy_reference_values():
    s = _reference_scores()
    for case in REFERENCE["clopper_pearson"]:
        ours = stats.epsilon_clopper_pearson(s["in"], s["out"], 1 - case["significance"], case["delta"],
                                             case["threshold"])
        assert ours == pytest.approx(case["epsilon"], rel=1e-9, abs=1e-12), case


def test_one_run_matches_jax_privacy_reference_values():
    s = _reference_scores()
    m = s["one_run_in"].size + s["one_run_out"].size
    for case in REFERENCE["one_run"]:
        tp, fp = int((s["one_run_in"] >= case["threshold"]).sum()), int((s["one_run_out"] >= case["threshold"]).sum())
        ours = stats.epsilon_one_run_counts(m, tp + fp, tp, 0.05, case["delta"])
        assert ours == pytest.approx(case["epsilon"], rel=1e-5, abs=1e-6), case


def test_bonferroni_is_the_best_threshold_at_alpha_over_k_and_below_jax_frontier_rule():
    s = _reference_scores()
    t = stats.thresholds(s["in"], s["out"])
    best = max(stats.epsilon_clopper_pearson(s["in"], s["out"], 1 - 0.05 / t.size, 1e-3, float(x)) for x in t)
    ours = stats.epsilon_clopper_pearson(s["in"], s["out"], 0.95, 1e-3, "bonferroni")
    assert ours == pytest.approx(best, rel=1e-12)
    # JAX Privacy divides α by the thresholds on the ROC's Pareto frontier only; ours by all of them
    assert 0 < ours <= REFERENCE["bonferroni_epsilon"]


def test_against_jax_privacy_live():
    auditing = pytest.importorskip("jax_privacy.auditing")
    rng = np.random.default_rng(5)
    s_in, s_out = np.round(rng.standard_normal(400) + 1.0, 1), np.round(rng.standard_normal(500), 1)
    auditor = auditing.CanaryScoreAuditor(s_in, s_out)
    for t in (0.5, 1.5, 2.5):
        for delta in (0.0, 1e-2):
            expected = auditor.epsilon_clopper_pearson(0.05, delta, threshold_strategy=auditing.Explicit(t))
            assert stats.epsilon_clopper_pearson(s_in, s_out, 0.95, delta, t) == pytest.approx(expected, rel=1e-9)
    m = s_in.size + s_out.size
    for t in (1.5, 2.5):
        tp, fp = int((s_in >= t).sum()), int((s_out >= t).sum())
        expected = auditor.epsilon_one_run(0.05, 1e-5, threshold_strategy=auditing.Explicit(t))
        assert stats.epsilon_one_run_counts(m, tp + fp, tp, 0.05, 1e-5) == pytest.approx(expected, rel=1e-5)


def test_statistics_closed_forms():
    # no false positive among n: the upper bound solves (1 − p)^n = α
    assert stats.clopper_pearson_upper(0, 200, 0.05) == pytest.approx(1 - 0.05 ** (1 / 200))
    # perfectly separated scores: ε_lo = ln(TPR_lo / FPR_hi) with both bounds in closed form at α/2 each
    n = 100
    expected = np.log((0.025 ** (1 / n)) / (1 - 0.025 ** (1 / n)))
    assert stats.epsilon_clopper_pearson(np.ones(n), np.zeros(n), 0.95, 0.0, 0.5) == pytest.approx(expected)
    # one run, δ = 0: the p-value is a binomial tail at q = e^ε/(1 + e^ε)
    assert stats.one_run_p_value(1000, 100, 80, 1.0, 0.0) == pytest.approx(
        scipy.stats.binom.sf(79, 100, np.exp(1) / (1 + np.exp(1))))
    # AUC: the fraction of (in, out) pairs ordered right, ties half
    rng = np.random.default_rng(0)
    a, b = np.round(rng.standard_normal(50), 1), np.round(rng.standard_normal(60), 1)
    pairs = (a[:, None] > b[None, :]).mean() + 0.5 * (a[:, None] == b[None, :]).mean()
    assert stats.auc(a, b) == pytest.approx(pairs)
    # identical worlds give no evidence
    same = rng.standard_normal(300)
    assert stats.epsilon_clopper_pearson(same, same, 0.95, 1e-5) == 0.0


def test_statistics_reject_bad_input():
    with pytest.raises(ValueError, match="confidence"):
        stats.epsilon_clopper_pearson([1.0], [0.0], confidence=1.5)
    with pytest.raises(ValueError, match="finite"):
        stats.epsilon_clopper_pearson([np.nan], [0.0])


# --- audits of the algorithms ---------------------------------------------------------------------------------

def _cells(**grid):
    base = dict(name="t", datasets=[{"name": "synthetic", "n": 400, "dim": 5}], models=["logreg"], seeds=1,
                delta=1e-5, clip_norm=1.0, l2=1e-3, lr=0.5, epochs=1, batch_size=32)
    return expand(GridFile.model_validate({"grids": [{**base, **grid}]}).grids[0])


@dataclasses.dataclass(frozen=True)
class ClipSum(Op):
    """A broken clip: the batch's summed gradient clipped to the norm, instead of each example's."""

    norm: float

    def update(self, grad, state, params):
        norm = np.linalg.norm(grad, axis=1, keepdims=True)
        return grad * np.minimum(1.0, self.norm / np.maximum(norm, 1e-300)), state


class _BrokenDPSGD(DPSGD):
    """Test-only broken DP-SGD (never registered): "clip_batch" clips the batch's summed gradient instead of each
    example's; "same_noise" reuses one noise vector at every step."""

    kind = ""

    def prepare(self, setting, model, X, y, streams):
        from dpsgd_cli.privacy.accounting import calibrate_sigma

        cal = calibrate_sigma(*self.sigma_calibration(setting))
        draws = streams.normal("noise", (model.n_params,))
        clip: Op = Clip(setting.clip_norm)
        if self.kind == "clip_batch":
            clip = ClipSum(setting.clip_norm)
        elif self.kind == "same_noise":
            draws = itertools.repeat(next(draws))
        chain = self.chain(setting, X, y, streams, (clip, Noise(cal.sigma * setting.clip_norm, draws)))
        return self._prepared(setting, model, X, streams, chain, {"sigma": cal.sigma, "epsilon_achieved": cal.epsilon},
                              "proved")


def _broken(kind: str) -> DPSGD:
    if kind == "noise_x0.1":
        return DPSGD({"accountant": "pld"}).with_noise_scale(0.1)
    return type(f"Broken_{kind}", (_BrokenDPSGD,), {"kind": kind})({"accountant": "pld"})


SOUND = ["dp_sgd", {"name": "dp_lssgd", "smoothing": 1.0},
         {"name": "bolt_on", "case": "convex", "calibration": "analytic"},
         {"name": "output_perturbation", "calibration": "analytic"},
         {"name": "noisy_gd", "accountant": "composition", "lr": [1.0], "epochs": [10]},
         {"name": "song2013", "batch_size": [40], "lr": [1.0]}]


def test_sound_algorithms_are_not_flagged():
    spec = AuditSpec(canaries=["input"], trials=150, control=None)
    for cell in _cells(algorithms=SOUND, epsilon=[0.5, 1, 4]):
        for row in audit_cell(cell, spec):
            assert row["status"] == "ok", row
            assert row["epsilon_lo"] <= row["epsilon_claimed"], row


def _one_step(epsilon: float, delta: float):
    """DP-SGD with T = 1, q = 1 (a full batch: the training set's n records), PLD-calibrated σ."""
    n = dataset(_cells(algorithms=["dp_sgd"])[0].dataset).n
    return _cells(algorithms=[{"name": "dp_sgd", "accountant": "pld"}], epsilon=[epsilon], delta=delta,
                  batch_size=n, lr=1.0)[0]


def test_white_box_one_step_audit_is_nearly_tight():
    """Power: the gradient canary against one Gaussian step reaches ε_lo ≥ ε/2 at ε = 2 (δ = 10⁻², where a few
    thousand trials resolve the decisive tail; at δ = 10⁻⁵ the same needs ~10⁵ trials)."""
    [last, _] = audit_cell(_one_step(2.0, 1e-2), AuditSpec(canaries=["gradient"], trials=5000, chunk=5000,
                                                                     control=None))
    assert last["threat_model"] == "white-box, last iterate"
    assert last["epsilon_claimed"] / 2 <= last["epsilon_lo"] <= last["epsilon_claimed"], last
    # beside the measured TPR, the accountant's bound for one Gaussian step: Φ(Φ⁻¹(α) + 1/σ), just above it
    for fpr in ("1e-2", "1e-3"):
        exact = scipy.stats.norm.cdf(scipy.stats.norm.ppf(float(fpr)) + 1 / last["sigma"])
        assert exact <= last[f"tpr_bound_fpr_{fpr}"] <= exact * 1.03, (fpr, exact, last)


def test_replace_one_audit_uses_the_mirror_record():
    """Under replace-one the out world holds the canary's mirror (gradient −C·u), not the null record: the two
    worlds' gradients differ by 2C, the sensitivity noisy GD is calibrated for. One full-batch step at a claimed
    ε = 2 (δ = 10⁻²; the exact ε of the released Gaussian, 1.66, is below the claim because the RDP conversion is
    loose): ε_lo reaches half the exact ε with the mirror, a seventh with the null record."""
    from dpsgd_cli.algorithms.noisy_gd import NoisyGD

    cell = _cells(algorithms=[{"name": "noisy_gd", "accountant": "composition", "lr": [1.0], "epochs": [1]}],
                  epsilon=[2.0], delta=1e-2)[0]
    spec = AuditSpec(canaries=["gradient"], trials=5000, chunk=5000, control=None)
    [mirror, _] = audit_cell(cell, spec)
    n = dataset(cell.dataset).n + 1  # with the canary's row
    z = np.sqrt(2.0) * mirror["sigma"] / (2.0 / n)  # step noise std √(2η)σ over the step's sensitivity 2C/n, η = 1
    exact = _gaussian_epsilon(z, 1e-2)
    assert mirror["neighbours"] == "replace_one" and mirror["steps"] == 1
    assert exact / 2 <= mirror["epsilon_lo"] <= exact <= mirror["epsilon_claimed"], (mirror, exact)
    null_tags = dataclasses.replace(NoisyGD.tags, neighbours="add_remove")
    null_out = type("NullOut", (NoisyGD,), {"tags": null_tags})(cell.algorithm.params)  # test-only
    [null, _] = audit_cell(cell, spec, algorithm=null_out)
    assert null["epsilon_lo"] < exact / 2, null


def test_signed_all_iterates_score_tells_the_canary_from_its_mirror():
    """Updates with a drift and the canary's −η·C·s at one step (s = +1 in, −1 mirror): |jumps| are equal in both
    worlds, the signed departure is +η·C·s, at the first, a middle and the last step."""
    from dpsgd_cli.audit.canaries import _signed_departure

    drift = -0.01 * np.linspace(1.0, 2.0, 8)
    for t in (0, 3, 7):
        for s in (1.0, -1.0):
            updates = drift.copy()
            updates[t] -= 0.5 * s
            score = _signed_departure(updates[:, None, None])[0, 0]
            assert np.sign(score) == s and abs(abs(score) - 0.5) < 0.02, (t, s, score)


def _gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    accountant = PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
    return accountant.get_epsilon(delta)


def test_noise_scaled_down_is_caught():
    spec = AuditSpec(canaries=["gradient"], trials=1000, chunk=2000, control=None)
    [row, _] = audit_cell(_one_step(1.0, 1e-5), spec, algorithm=_broken("noise_x0.1"))
    assert row["epsilon_lo"] > 1.0, row
    [sound, _] = audit_cell(_one_step(1.0, 1e-5), spec)
    assert sound["epsilon_lo"] <= 1.0, sound


def test_clipping_the_batch_sum_is_caught():
    """clip(S + g) − clip(S) reaches 2C against C: a canary whose gradient opposes the data's, one full step."""
    spec = AuditSpec(canaries=["gradient"], trials=5000, chunk=5000, direction="against_data", control=None)
    [row, _] = audit_cell(_one_step(1.0, 1e-2), spec, algorithm=_broken("clip_batch"))
    assert row["epsilon_lo"] > 1.0, row
    [sound, _] = audit_cell(_one_step(1.0, 1e-2), spec)
    assert sound["epsilon_lo"] <= 1.0, sound


def _data_with_an_unused_direction(n: int = 200) -> Dataset:
    rng = np.random.default_rng(3)
    X = rng.standard_normal((n, 4))
    X = np.hstack([X / np.linalg.norm(X, axis=1, keepdims=True), np.zeros((n, 1))])
    y = np.where(X[:, 0] + 0.3 * X[:, 1] > 0, 1.0, -1.0)
    base = dataset(_cells(algorithms=["dp_sgd"])[0].dataset)
    return Dataset(base.spec, X, y, X[:20], y[:20])


def test_reusing_one_noise_vector_is_caught():
    """The same noise at every step cancels in differences of consecutive updates: an adversary who sees every
    iterate reads the canary's inclusions off them (q = 1/2, T = 10)."""
    data = _data_with_an_unused_direction()
    cell = _cells(algorithms=["dp_sgd"], epsilon=[1.0], batch_size=100, epochs=5)[0]
    spec = AuditSpec(canaries=["gradient"], trials=200, control=None)
    [_, every] = audit_cell(cell, spec, algorithm=_broken("same_noise"), data=data)
    assert every["threat_model"] == "white-box, all iterates"
    assert every["epsilon_lo"] > 1.0, every
    [_, sound] = audit_cell(cell, spec, data=data)
    assert sound["epsilon_lo"] <= 1.0, sound


def test_gradient_canary_is_not_applicable_to_output_perturbation():
    cell = _cells(algorithms=[{"name": "output_perturbation", "calibration": "analytic"}])[0]
    rows = audit_cell(cell, AuditSpec(canaries=["gradient"], trials=10))
    assert {r["status"] for r in rows} == {"not applicable"}


def test_one_run_audit_of_dp_sgd_stays_below_the_claim():
    cell = _cells(algorithms=["dp_sgd"], epsilon=[1.0])[0]
    [last, every] = audit_cell(cell, AuditSpec(canaries=["dirac"], statistic="one_run", m_canaries=50, trials=2,
                                               control=None))
    assert 0 <= last["epsilon_lo"] <= 1.0 and 0 <= every["epsilon_lo"] <= 1.0


# --- command line and report ------------------------------------------------------------------------------------

GRID = """
grids:
  - name: tiny_audit
    datasets: [{name: synthetic, n: 300, dim: 5}]
    algorithms: [dp_sgd, {name: output_perturbation, calibration: analytic}]
    epsilon: [1]
    batch_size: [32]
    epochs: 1
    lr: 0.5
    l2: 1.0e-3
    seeds: 1
    delta: 1.0e-5
    audit: {canaries: [input], trials: 50, threshold: order}
"""


def test_cli_audit_writes_csv_figure_and_report(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(GRID))
    result = CliRunner().invoke(app, ["audit", str(grid), "--out", str(tmp_path / "res"), "--trials", "40"])
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(tmp_path / "res" / "tiny_audit" / "audit.csv")
    assert len(frame) == 2 and (frame["trials"] == 40).all() and (frame["status"] == "ok").all()
    for column in ("epsilon_claimed", "delta", "epsilon_lo", "auc", "tpr_at_fpr_1e-2", "tpr_at_fpr_1e-3", "canary",
                   "threat_model", "wall_time", "tpr_bound_fpr_1e-2", "tpr_bound_fpr_1e-3"):
        assert frame[column].notna().all(), column
    assert (tmp_path / "res" / "tiny_audit" / "figures" / "audit.png").exists()
    # every bound recomputed from the raw scores saved beside the CSV, at the row's own confidence and claim (the
    # rule order's ranks), the twin's at its own family's level
    for _, row in frame.iterrows():
        saved = np.load(tmp_path / "res" / "tiny_audit" / row["scores_file"])
        key = f"{row['canary']}.{row['threat_model'].replace(', ', '_').replace(' ', '_')}"
        again = stats.epsilon_clopper_pearson(saved[key + ".in"], saved[key + ".out"], row["row_confidence"],
                                              row["delta"], row["threshold"], claim=row["epsilon_claimed"])
        assert again == pytest.approx(row["epsilon_lo"], abs=1e-12)
        twin = stats.epsilon_clopper_pearson(saved["control." + key + ".in"], saved["control." + key + ".out"],
                                             row["control_row_confidence"], row["delta"], row["threshold"],
                                             claim=row["epsilon_claimed"])
        assert twin == pytest.approx(row["control_epsilon_lo"], abs=1e-12)
        assert row["verdict"] in ("refuted", "consistent", "uninformative", "not covered")
    report = CliRunner().invoke(app, ["report", str(tmp_path / "res")])
    assert report.exit_code == 0, report.output
    text = (tmp_path / "res" / "report.md").read_text()
    assert "audit" in text.lower() and "measured, ≤" in text  # the measured TPR beside the accountant's bound


def test_audit_verdicts_name_refuted_claims():
    from dpsgd_cli.report import audit_verdicts

    frame = pd.DataFrame([
        {"grid": "g", "dataset": "d", "model": "logreg", "algorithm": "a", "epsilon_claimed": 1.0, "delta": 1e-5,
         "epsilon_lo": 2.5, "canary": "gradient", "threat_model": "white-box, last iterate", "trials": 100,
         "confidence": 0.95, "status": "ok"},
        {"grid": "g", "dataset": "d", "model": "logreg", "algorithm": "b", "epsilon_claimed": 1.0, "delta": 1e-5,
         "epsilon_lo": 0.2, "canary": "input", "threat_model": "black-box, last iterate", "trials": 100,
         "confidence": 0.95, "status": "ok"}])
    verdicts = {v["algorithm"]: v for v in audit_verdicts(frame)}
    assert verdicts["a"]["verdict"] == "refuted" and "2.5 > 1" in verdicts["a"]["numbers"]
    assert verdicts["b"]["verdict"] == "consistent"


def test_cli_audit_bad_input_is_one_line_with_exit_code_2(tmp_path):
    import subprocess
    import sys

    args, expected = ["--confidence", "1.5"], "--confidence"
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(GRID))
    proc = subprocess.run([sys.executable, "-m", "dpsgd_cli", "audit", str(grid), "--out", str(tmp_path), *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry-run"])
def test_an_audit_of_a_non_private_algorithm_is_refused_before_any_work(tmp_path, dry_run):
    import subprocess
    import sys

    from dpsgd_cli.algorithms import ALGORITHMS

    public = sorted(name for name, algorithm in ALGORITHMS.items() if not algorithm.tags.private)
    assert public  # the refusal follows the algorithms' own `private`, whichever they are
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(GRID).replace("algorithms: [dp_sgd,", f"algorithms: [{', '.join(public)}, dp_sgd,"))
    proc = subprocess.run([sys.executable, "-m", "dpsgd_cli", "audit", str(grid), "--out", str(tmp_path / "res"),
                           *dry_run], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert all(name in proc.stderr for name in public) and "dp_sgd" not in proc.stderr, proc.stderr
    assert not (tmp_path / "res").exists()  # nothing trained, nothing written
