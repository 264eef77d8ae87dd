"""Non-private reference: the exact minimiser of the regularised objective F (gives L* for the optimality gap)."""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Setting
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import Model


def minimize_objective(model: Model, X: np.ndarray, y: np.ndarray, theta0: np.ndarray) -> tuple[np.ndarray, dict]:
    """Full-batch L-BFGS with tight tolerances from θ0 (P,); returns (θ*, info)."""

    def fun(flat: np.ndarray) -> tuple[float, np.ndarray]:
        theta = flat[None, :]
        return float(model.objective(theta, X, y)[0]), model.gradient(theta, X, y)[0]

    res = minimize(fun, theta0, jac=True, method="L-BFGS-B",
                   options={"maxiter": 20000, "maxfun": 40000, "gtol": 1e-9, "ftol": 1e-15})
    info = {"lbfgs_iterations": int(res.nit), "lbfgs_converged": bool(res.success),
            "grad_norm": float(np.linalg.norm(fun(res.x)[1]))}
    return res.x, info


class ERM(Algorithm):
    """argmin_θ F(θ) by L-BFGS; deterministic, so every seed gets the same θ*."""

    name = "erm"
    private = False
    uses = frozenset({"l2"})
    source = "non-private empirical risk minimiser"

    def fit(self, setting: Setting, model: Model, X, y, streams: ReplicaStreams) -> Outcome:
        theta0 = model.init(streams.generators("init")[:1])[0]
        theta, info = minimize_objective(model, X, y, theta0)
        return Outcome(np.tile(theta, (streams.replicas, 1)), info, guarantee="non-private")
