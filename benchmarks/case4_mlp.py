"""Case 4: dp_sgd on the one-hidden-layer MLP (adult, B = 256, 10 replicas): time per step, and the same steps with
the clipped gradient sum computed by a naive loop over examples (one forward/backward per example and replica,
through the model's own code on single-example batches). Skipped while `make_model("mlp", d, l2)` is missing.
"""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits

from benchmarks.common import Row, Skip, best_of, fmt_time, load, logreg_setting

REPLICAS = 10


def naive_clipped_grad_sum(model, theta: np.ndarray, batch, clip: float) -> np.ndarray:
    """Σ_i clip(∇ℓ_i) for every replica, one example at a time."""
    from dpsgd_cli.models import Batch

    out = np.zeros_like(theta)
    R, M = batch.weight.shape
    for r in range(R):
        for i in range(M):
            if batch.weight[r, i] == 0:
                continue
            one = Batch(X=batch.X[r:r + 1, i:i + 1], y=batch.y[r:r + 1, i:i + 1],
                        weight=batch.weight[r:r + 1, i:i + 1], x_norm=batch.x_norm[r:r + 1, i:i + 1])
            out[r] += model.clipped_grad_sum(theta[r:r + 1], one, clip)[0]
    return out


def run(ctx) -> list[Row]:
    what = f"dp_sgd MLP adult, B = 256, R = {REPLICAS}, per step"
    try:
        from dpsgd_cli.models import make_model

        data = load({"name": "adult"})
        model = make_model("mlp", data.d, 1e-4)
    except Skip as skip:
        return [Row("4", what, note=f"skipped: {skip}")]
    except Exception as exc:  # no MLP yet (unknown model name) or it does not import
        return [Row("4", what, note=f"skipped: no MLP yet ({type(exc).__name__}: {str(exc)[:120]})")]

    from dpsgd_cli.algorithms import ALGORITHMS
    from dpsgd_cli.algorithms.chain import GradientChain
    from dpsgd_cli.algorithms.ops import Clip, Noise, Scale, Sgd, WeightDecay, constant
    from dpsgd_cli.algorithms.sampling import poisson_batches
    from dpsgd_cli.algorithms.streams import ReplicaStreams
    from dpsgd_cli.privacy.accounting import calibrate_sigma

    steps = 5 if ctx.quick else 20
    setting = logreg_setting(data, epochs=steps * 256 / data.n)
    assert setting.steps == steps
    cal = calibrate_sigma(setting.epsilon, setting.delta, setting.sample_rate, setting.steps)
    X, y = data.X_train, data.y_train
    fit = lambda: ALGORITHMS["dp_sgd"]().fit(setting, model, X, y, ReplicaStreams(range(REPLICAS)))  # noqa: E731

    # the naive loop: the same chain (batches, noise, update) with the per-example loop as the gradient
    class Naive:
        def __getattr__(self, name):
            return getattr(model, name)

        def clipped_grad_sum(self, theta, batch, clip):
            return naive_clipped_grad_sum(model, theta, batch, clip)

    naive_steps = 1 if ctx.quick else 2

    def chain_run(m, count):
        streams = ReplicaStreams(range(REPLICAS))
        chain = GradientChain(batches=poisson_batches(X, y, setting.sample_rate, streams),
                              ops=[Clip(setting.clip_norm),
                                   Noise(cal.sigma * setting.clip_norm, streams.normal("noise", (model.n_params,))),
                                   Scale(1.0 / setting.batch_size), WeightDecay(setting.l2), Sgd(constant(setting.lr))],
                              backend="numpy")
        return chain.run(m, model.init(streams.generators("init")), count)

    diff = float(np.max(np.abs(chain_run(model, naive_steps) - chain_run(Naive(), naive_steps))))
    rows = []
    # BLAS threads matter: on a machine shared with other jobs, OpenBLAS's threads contend for the cores
    for case, threads in (("4a", None), ("4b", 1)):
        with threadpool_limits(threads):
            ours, _ = best_of(fit, ctx.k, warmup=1)
            naive, _ = best_of(lambda: chain_run(Naive(), naive_steps), ctx.k)
        per_step, naive_step = ours.min / steps, naive.min / naive_steps
        label = "default BLAS threads" if threads is None else f"{threads} BLAS thread"
        rows.append(Row(
            case, f"{what} ({label})", ours=f"{fmt_time(per_step)}/step",
            comparison=f"per-example loop {fmt_time(naive_step)}/step", ratio=naive_step / per_step,
            note=(f"P = {model.n_params} parameters per replica; {steps} steps timed (fit), loop {naive_steps}; "
                  f"max |Δθ| loop vs vectorised = {diff:.1e}; {label}"
                  + (f" ({_threads()})" if threads is None else "")),
            data={"ours": ours.json(), "ours_per_step_s": per_step, "naive": naive.json(),
                  "naive_per_step_s": naive_step, "steps": steps, "naive_steps": naive_steps,
                  "n_params": model.n_params, "max_abs_diff": diff, "blas_threads": threads}))
    return rows


def _threads() -> str:
    from threadpoolctl import threadpool_info

    return ", ".join(f"{i['internal_api']} {i['num_threads']}" for i in threadpool_info())
