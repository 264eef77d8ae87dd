"""Non-private reference: the minimiser of the regularised objective F (gives L* for the optimality gap).

Convex models: one full-batch L-BFGS run from model.init (seed 0) gives the global minimum. Non-convex models
(`mlp`): L* is no longer a global optimum; it is the best objective over `REFERENCE_STARTS` full-batch L-BFGS runs
from the initialisations of seeds 0..starts−1 (the same θ₀ a seed-s SGD run starts from), and the info records
how it was obtained (every start's objective, iterations, convergence).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Setting
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import Model

REFERENCE_STARTS = 3  # L-BFGS starts for a non-convex model's reference minimum
_REFERENCE_CACHE: dict[tuple, tuple[np.ndarray, float, dict]] = {}  # in-process: the runner and `erm` share it


# L-BFGS settings. Convex: tight, the global minimum to ~machine precision. Non-convex: L-BFGS stops at a local
# minimum (max |∂F/∂θ_j| ≤ gtol) or after `maxiter` iterations; on adult (P = 11,025) a start needs ~3,000 iterations
# to converge (objective then stable to ~1e-8), so the capped L* is slightly above that local minimum.
LBFGS_CONVEX = {"maxiter": 20000, "gtol": 1e-9, "ftol": 1e-15}
# Non-convex L*: a local optimum at best; capped so a Kang et al. grid computes it in about a minute per dataset
# (uncapped: ~1000 s on adult, hours on kddcup99). Recorded as derived.optimum_method.
LBFGS_NONCONVEX = {"maxiter": 300, "gtol": 1e-6, "ftol": 1e-13}


def minimize_objective(model: Model, X: np.ndarray, y: np.ndarray, theta0: np.ndarray,
                       maxiter: int = 20000, gtol: float = 1e-9, ftol: float = 1e-15) -> tuple[np.ndarray, dict]:
    """Full-batch L-BFGS (tight tolerances by default) from θ0 (P,); returns (θ*, info)."""

    def fun(flat: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = model.objective_and_gradient(flat[None, :], X, y)
        return float(value[0]), grad[0]

    res = minimize(fun, theta0, jac=True, method="L-BFGS-B",
                   options={"maxiter": maxiter, "maxfun": 2 * maxiter, "gtol": gtol, "ftol": ftol})
    info = {"lbfgs_iterations": int(res.nit), "lbfgs_converged": bool(res.success),
            "grad_norm": float(np.linalg.norm(fun(res.x)[1]))}
    return res.x, info


def _cache_key(model: Model, X: np.ndarray, y: np.ndarray, starts: int) -> tuple:
    digest = hashlib.sha1()
    for array in (X, y):
        a = np.ascontiguousarray(array)
        digest.update(str((a.shape, a.dtype.str)).encode())
        digest.update(a.view(np.uint8).reshape(-1) if a.size else b"")
    options = tuple(sorted((k, repr(v)) for k, v in vars(model).items()))
    return type(model).__name__, options, digest.hexdigest(), starts


def reference_minimum(model: Model, X: np.ndarray, y: np.ndarray,
                      starts: int = REFERENCE_STARTS) -> tuple[np.ndarray, float, dict[str, Any]]:
    """(θ (P,), F(θ), info): the exact minimiser for a convex model (one L-BFGS run from model.init of seed 0);
    for a non-convex model the best of `starts` L-BFGS runs from model.init of seeds 0..starts−1.

    info: `optimum_method` ("lbfgs" | "lbfgs_best_of_<k>"), `starts`, `best_start` (its seed), `start_results`
    {seed: {objective, iterations, converged}}, and for the best run `lbfgs_iterations`, `lbfgs_converged`,
    `grad_norm`. Deterministic; cached in-process by (model, data, starts).
    """
    starts = 1 if model.convex else int(starts)
    if starts < 1:
        raise ValueError(f"reference_minimum needs starts ≥ 1, got {starts}")
    key = _cache_key(model, X, y, starts)
    if key in _REFERENCE_CACHE:
        theta, objective, info = _REFERENCE_CACHE[key]
        return theta.copy(), objective, dict(info)
    inits = model.init(ReplicaStreams(range(starts)).generators("init"))
    # one BLAS thread: a capped non-convex L-BFGS path changes with the summation order, and L* must be the
    # same in the main process and in every worker
    with threadpool_limits(1):
        runs = [minimize_objective(model, X, y, theta0, **(LBFGS_CONVEX if model.convex else LBFGS_NONCONVEX))
                for theta0 in inits]
    objectives = [float(model.objective(theta[None], X, y)[0]) for theta, _ in runs]
    best = int(np.argmin(objectives))
    theta, best_info = runs[best]
    # per start: a dict keyed by seed, not a list (the runner spreads a list of length R over the replicas' rows)
    info = {"optimum_method": "lbfgs" if model.convex else f"lbfgs_best_of_{starts}", "starts": starts,
            "best_start": best, **best_info,
            "start_results": {str(s): {"objective": objectives[s], "iterations": runs[s][1]["lbfgs_iterations"],
                                       "converged": runs[s][1]["lbfgs_converged"]} for s in range(starts)}}
    _REFERENCE_CACHE[key] = (theta.copy(), objectives[best], dict(info))
    return theta, objectives[best], info


class ERM(Algorithm):
    """argmin_θ F(θ) by L-BFGS (best of several starts for a non-convex model, see `reference_minimum`);
    deterministic, so every seed gets the same θ."""

    name = "erm"
    private = False
    uses = frozenset({"l2"})
    source = "non-private empirical risk minimiser"

    def fit(self, setting: Setting, model: Model, X, y, streams: ReplicaStreams) -> Outcome:
        theta, _, info = reference_minimum(model, X, y)
        return Outcome(np.tile(theta, (streams.replicas, 1)), info, guarantee="non-private")
