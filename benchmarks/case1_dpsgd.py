"""Case 1: dp_sgd on adult (logistic regression, B = 256, 1 epoch) at R = 1 and R = 16 replicas.

Ours: `DPSGD().fit` (Poisson batches, clip, noise, all replicas in one chain; σ calibrated beforehand, the
calibration is case 6). Against (b) `numpy_dpsgd` below, a straightforward NumPy DP-SGD that materialises the
(B, d) per-example gradients and loops over replicas (Opacus and JAX: case 8, pinned and interleaved). Unit:
replica-steps per second (R × 118 steps / best time). Also float32 vs float64 on our chain.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

from benchmarks.common import Row, Skip, accuracy, best_of, fmt_rate, fmt_time, load, logreg_setting


def numpy_dpsgd(X: np.ndarray, y: np.ndarray, replicas: int, steps: int, q: float, clip: float, sigma: float,
                lr: float, l2: float, batch_size: int) -> np.ndarray:
    """The baseline: DP-SGD written the obvious way, one replica after another (θ from 0, Poisson sampling by a
    uniform per example and step, per-example gradients (m, d), clip each, sum, noise, mean, λθ, step)."""
    n, d = X.shape
    out = np.zeros((replicas, d))
    for r in range(replicas):
        rng = np.random.default_rng([r, 99])
        theta = np.zeros(d)
        for _ in range(steps):
            mask = rng.random(n) < q
            Xb, yb = X[mask], y[mask]
            grads = (-yb * expit(-yb * (Xb @ theta)))[:, None] * Xb  # per-example gradients (m, d)
            norms = np.linalg.norm(grads, axis=1)
            grads *= np.minimum(1.0, clip / np.maximum(norms, 1e-12))[:, None]
            noisy = grads.sum(axis=0) + sigma * clip * rng.standard_normal(d)
            theta -= lr * (noisy / batch_size + l2 * theta)
        out[r] = theta
    return out


def chain_run(data, setting, sigma: float, replicas: int, dtype) -> np.ndarray:
    """DPSGD.fit's chain with the data, θ₀ (and so θ) in `dtype` (float32: the same code path, float32 arrays)."""
    from dpsgd_cli.algorithms import ALGORITHMS
    from dpsgd_cli.algorithms.ops import Clip, Noise
    from dpsgd_cli.algorithms.streams import ReplicaStreams
    from dpsgd_cli.models import make_model

    X, y = data.X_train.astype(dtype, copy=False), data.y_train.astype(dtype, copy=False)
    model = make_model("logreg", data.d, setting.l2)
    streams = ReplicaStreams(range(replicas))
    noise = Noise(sigma * setting.clip_norm, streams.normal("noise", (model.n_params,)))
    chain = ALGORITHMS["dp_sgd"]().chain(setting, X, y, streams, (Clip(setting.clip_norm), noise))
    return chain.run(model, model.init(streams.generators("init")).astype(dtype), setting.steps)


def run(ctx) -> list[Row]:
    from dpsgd_cli.algorithms import ALGORITHMS
    from dpsgd_cli.algorithms.streams import ReplicaStreams
    from dpsgd_cli.models import make_model
    from dpsgd_cli.privacy.accounting import calibrate_sigma

    try:
        data = load({"name": "adult"})
    except Skip as skip:
        return [Row("1", "dp_sgd adult, logreg, B = 256, 1 epoch", note=f"skipped: {skip}")]
    setting = logreg_setting(data)
    steps = setting.steps
    cal = calibrate_sigma(setting.epsilon, setting.delta, setting.sample_rate, steps)  # cached for the fits
    model = make_model("logreg", data.d, setting.l2)
    k = ctx.k
    rows: list[Row] = []
    ours: dict[int, tuple] = {}
    for R in (1, 16):
        fit = lambda: ALGORITHMS["dp_sgd"]().fit(setting, model, data.X_train, data.y_train,  # noqa: E731
                                                 ReplicaStreams(range(R)))
        timing, outcome = best_of(fit, k, warmup=1)
        ours[R] = (timing, float(accuracy(outcome.theta, data.X_test, data.y_test).mean()))
        base = lambda: numpy_dpsgd(data.X_train, data.y_train, R, steps, setting.sample_rate,  # noqa: E731
                                   setting.clip_norm, cal.sigma, setting.lr, setting.l2, setting.batch_size)
        btiming, btheta = best_of(base, k)
        ours_rate, base_rate = R * steps / timing.min, R * steps / btiming.min
        rows.append(Row(
            f"1{'ab'[R > 1]}", f"dp_sgd adult R = {R}: ours vs NumPy per-example loop",
            ours=f"{fmt_rate(ours_rate, 'replica-steps')} ({fmt_time(timing.min)}/epoch)",
            comparison=f"{fmt_rate(base_rate, 'replica-steps')} ({fmt_time(btiming.min)})",
            ratio=ours_rate / base_rate, ratio_label="×",
            note=(f"σ = {cal.sigma:.4g}, {steps} steps; test accuracy ours {ours[R][1]:.4f}, baseline "
                  f"{float(accuracy(btheta, data.X_test, data.y_test).mean()):.4f}"),
            data={"replicas": R, "steps": steps, "ours": timing.json(), "baseline": btiming.json(),
                  "ours_replica_steps_per_s": ours_rate, "baseline_replica_steps_per_s": base_rate}))

    # float32 vs float64: the same chain, float32 data and θ (noise is drawn in float64 and added)
    for R in (1, 16):
        t64, th64 = best_of(lambda: chain_run(data, setting, cal.sigma, R, np.float64), k, warmup=1)
        t32, th32 = best_of(lambda: chain_run(data, setting, cal.sigma, R, np.float32), k, warmup=1)
        a64 = float(accuracy(th64, data.X_test, data.y_test).mean())
        a32 = float(accuracy(th32.astype(np.float64), data.X_test, data.y_test).mean())
        rows.append(Row(
            f"1{'ef'[R > 1]}", f"dp_sgd adult R = {R}: float32 vs float64 (same chain)",
            ours=f"float32 {fmt_time(t32.min)}/epoch", comparison=f"float64 {fmt_time(t64.min)}",
            ratio=t64.min / t32.min, ratio_label="×",
            note=(f"test accuracy float32 {a32:.4f} vs float64 {a64:.4f}; max |θ32 − θ64| = "
                  f"{float(np.max(np.abs(th32 - th64))):.2e}"),
            data={"replicas": R, "float32": t32.json(), "float64": t64.json(), "accuracy_float32": a32,
                  "accuracy_float64": a64}))
    return rows
