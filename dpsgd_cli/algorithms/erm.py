"""Non-private reference: the minimiser of the regularised objective F (gives L* for the optimality gap).

Convex models: one full-batch L-BFGS run from model.init (seed 0); non-convex models (`mlp`): the lowest objective
of `REFERENCE_STARTS` runs from seeds 0..starts−1, each stopped once F has stopped falling (`LBFGS_NONCONVEX`) — a
local optimum's objective to within that rule, not a global minimum. Kept in the verified disk cache
(docs/datasets.md)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import math
import weakref
from typing import Any, TypedDict

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from dpsgd_cli import diskcache
from dpsgd_cli.algorithms.base import Algorithm, Outcome, Setting, Tags
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.models import Model

optimize = LazyModule("scipy.optimize")  # not needed when L* comes from the disk cache

Info = dict[str, Any]
Reference = tuple[np.ndarray, float, Info]  # (θ*, F(θ*), info)
CacheKey = tuple[str, tuple[tuple[str, str], ...], str, int]  # (model, its options, data sha1, starts)

REFERENCE_STARTS = 3  # L-BFGS starts for a non-convex model's reference minimum
_REFERENCE_CACHE: dict[CacheKey, Reference] = {}  # in-process: the runner and `erm` share it
REFERENCE_VERSION = "2"  # part of the disk cache key: bump it when a change could alter θ*, F(θ*) or the info


# L-BFGS settings. Convex: tight, the global minimum to ~machine precision. Non-convex: each start runs until its
# objective has stopped falling — by at most `plateau_decrease` over the last `plateau_iterations` iterations — or
# reaches a local minimum (max |∂F/∂θ_j| ≤ gtol), or `maxiter`. A gradient-norm tolerance does not suit the MLP:
# at λ = 1e-4 its ‖∇F‖ is still 1e-4 to 1e-3 where F falls by less than 1e-5 in 100 iterations (docs/performance.md
# "L* of the MLP").
class LBFGSOptions(TypedDict):
    maxiter: int
    gtol: float
    ftol: float
    plateau_iterations: int  # 0: no plateau rule
    plateau_decrease: float


LBFGS_CONVEX: LBFGSOptions = {"maxiter": 20000, "gtol": 1e-9, "ftol": 1e-15, "plateau_iterations": 0,
                              "plateau_decrease": 0.0}
# Non-convex L*: 1e-5 is 1% of the smallest gap a claim compares with (0.001). Over 100 iterations, not 50: a
# 50-iteration window stopped starts on kddcup99 and bank at iteration 106 and 361, on ledges F later fell from
# by 5.7e-4 and 3.2e-4. The cap bounds the cost (~3× the former 300 iterations); some of adult's starts reach it
# still falling. Recorded per start as `stop` (`LBFGS_STOPS`), its ‖∇F‖ and the decrease over its last 100 iterations
# (docs/performance.md "L* of the MLP").
LBFGS_NONCONVEX: LBFGSOptions = {"maxiter": 1000, "gtol": 1e-6, "ftol": 1e-13, "plateau_iterations": 100,
                                 "plateau_decrease": 1e-5}


# scipy's L-BFGS-B status → how a run stopped: its own tests (gtol, ftol), our plateau rule (the callback's
# StopIteration), maxiter or maxfun, a failed line search
LBFGS_STOPS = {0: "converged", 99: "plateau", 1: "cap", 2: "line_search"}


def minimize_objective(model: Model, X: np.ndarray, y: np.ndarray, theta0: np.ndarray,
                       maxiter: int = 20000, gtol: float = 1e-9, ftol: float = 1e-15, plateau_iterations: int = 0,
                       plateau_decrease: float = 0.0) -> tuple[np.ndarray, Info]:
    """Full-batch L-BFGS (tight tolerances by default) from θ0 (P,), stopped early once F has fallen by at most
    `plateau_decrease` over the last `plateau_iterations` iterations (when > 0); returns (θ*, info): its
    iterations, whether L-BFGS itself converged, how it stopped (`LBFGS_STOPS`), ‖∇F(θ*)‖ and F's decrease over
    its last `plateau_iterations` iterations (or all of them)."""
    rows = model.full_batch_rows(X)

    def fun(flat: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = model.objective_and_gradient(flat[None, :], rows, y)
        return float(value[0]), grad[0]

    path = [fun(theta0)[0]]  # F at θ0 and after every iteration

    def plateau(intermediate_result: Any) -> None:  # scipy.optimize.OptimizeResult
        path.append(float(intermediate_result.fun))
        if 0 < plateau_iterations < len(path) and path[-1 - plateau_iterations] - path[-1] <= plateau_decrease:
            raise StopIteration

    res = optimize.minimize(fun, theta0, jac=True, method="L-BFGS-B", callback=plateau,
                   options={"maxiter": maxiter, "maxfun": 2 * maxiter, "gtol": gtol, "ftol": ftol})
    window = min(plateau_iterations or len(path) - 1, len(path) - 1)
    stop = LBFGS_STOPS.get(int(res.status), "abnormal")
    info = {"lbfgs_iterations": int(res.nit), "lbfgs_converged": bool(res.success), "lbfgs_stop": stop,
            "grad_norm": float(np.linalg.norm(fun(res.x)[1])),
            "plateau_decrease": float(path[-1 - window] - path[-1])}
    return res.x, info


# sha1 of read-only arrays already hashed in this process, by id (with a weak reference that proves the id still
# names that array): the runner's datasets are read-only, and L* and `erm` cells ask for the same training set
_DIGESTS: dict[tuple[int, int], tuple[weakref.ref[np.ndarray], weakref.ref[np.ndarray], str]] = {}


def _data_digest(X: np.ndarray, y: np.ndarray) -> str:
    memo = not X.flags.writeable and not y.flags.writeable
    if memo:
        hit = _DIGESTS.get((id(X), id(y)))
        if hit is not None and hit[0]() is X and hit[1]() is y:
            return hit[2]
    digest = hashlib.sha1()
    for array in (X, y):
        a = np.ascontiguousarray(array)
        digest.update(str((a.shape, a.dtype.str)).encode())
        digest.update(a.view(np.uint8).reshape(-1).data if a.size else b"")
    if memo:
        for key in [key for key, (rx, ry, _) in _DIGESTS.items() if rx() is None or ry() is None]:
            del _DIGESTS[key]  # arrays freed since: their ids may name other arrays now
        _DIGESTS[id(X), id(y)] = (weakref.ref(X), weakref.ref(y), digest.hexdigest())
    return digest.hexdigest()


def _cache_key(model: Model, X: np.ndarray, y: np.ndarray, starts: int) -> CacheKey:
    options = tuple(sorted((k, repr(v)) for k, v in vars(model).items()))
    return type(model).__name__, options, _data_digest(X, y), starts


def reference_minimum(model: Model, X: np.ndarray, y: np.ndarray, starts: int = REFERENCE_STARTS,
                      runs: list[tuple[np.ndarray, Info]] | None = None) -> Reference:
    """(θ (P,), F(θ), info): the exact minimiser for a convex model; for a non-convex model the best of `starts`
    L-BFGS runs from model.init of seeds 0..starts−1. info: the fields `_INFO_FIELDS` (every start's objective,
    iterations and convergence). Deterministic; cached in-process and on disk. `runs`: the starts' `reference_start`
    results computed elsewhere (parallel processes), used only when the minimum is not cached."""
    starts = reference_starts(model, starts)
    value = known_reference(model, X, y, starts)
    if value is None:
        key = _cache_key(model, X, y, starts)
        value = _compute_reference(model, X, y, starts, runs)
        with contextlib.suppress(diskcache.Rejected):  # an entry that could not be verified is not kept
            _verify(model, X, y, starts, *value)
            _reference_to_disk(model, key, value)
        _REFERENCE_CACHE[key] = value
    theta, objective, info = value
    return theta.copy(), objective, dict(info)


def reference_starts(model: Model, starts: int = REFERENCE_STARTS) -> int:
    """The L-BFGS starts `reference_minimum` runs for `model`: one for a convex model."""
    starts = 1 if model.convex else int(starts)
    if starts < 1:
        raise ValueError(f"reference_minimum needs starts ≥ 1, got {starts}")
    return starts


def known_reference(model: Model, X: np.ndarray, y: np.ndarray,
                    starts: int = REFERENCE_STARTS) -> Reference | None:
    """The reference minimum if this process has it or the disk cache holds it (checked by `_verify`, ~2 passes
    over X, and kept in-process); None when it must be computed."""
    starts = reference_starts(model, starts)
    key = _cache_key(model, X, y, starts)
    if key not in _REFERENCE_CACHE:
        try:
            value = _reference_from_disk(model, key)
            if value is None:
                return None
            _verify(model, X, y, starts, *value)
        except diskcache.Rejected as exc:
            diskcache.discard(diskcache.cache_folder("reference"), _disk_key(model, key), str(exc))
            return None
        _REFERENCE_CACHE[key] = value
    return _REFERENCE_CACHE[key]


def reference_start(model: Model, X: np.ndarray, y: np.ndarray, seed: int) -> tuple[np.ndarray, Info]:
    """One L-BFGS run of `reference_minimum`, from model.init of `seed` (each seed's generator is its own, so a
    start does not depend on the others and may run in another process)."""
    theta0 = model.init(ReplicaStreams([seed]).generators("init"))[0]
    # one BLAS thread: a non-convex L-BFGS path, and where its plateau rule stops it, change with the summation
    # order, and L* must be the same in the main process and in every worker
    with threadpool_limits(1):
        return minimize_objective(model, X, y, theta0, **(LBFGS_CONVEX if model.convex else LBFGS_NONCONVEX))


def _compute_reference(model: Model, X: np.ndarray, y: np.ndarray, starts: int,
                       runs: list[tuple[np.ndarray, Info]] | None = None) -> Reference:
    if runs is None:
        runs = [reference_start(model, X, y, seed) for seed in range(starts)]
    if len(runs) != starts:
        raise ValueError(f"reference_minimum: {len(runs)} L-BFGS runs given for {starts} starts")
    objectives = [float(model.objective(theta[None], X, y)[0]) for theta, _ in runs]
    best = int(np.argmin(objectives))
    theta, best_info = runs[best]
    # per start: a dict keyed by seed, not a list (the runner spreads a list of length R over the replicas' rows)
    info = {"optimum_method": _optimum_method(model, starts), "starts": starts,
            "best_start": best, **best_info,
            "start_results": {str(s): {"objective": objectives[s], "iterations": runs[s][1]["lbfgs_iterations"],
                                       "converged": runs[s][1]["lbfgs_converged"], "stop": runs[s][1]["lbfgs_stop"],
                                       "grad_norm": runs[s][1]["grad_norm"],
                                       "plateau_decrease": runs[s][1]["plateau_decrease"]}
                              for s in range(starts)}}
    return theta, objectives[best], info


def _optimum_method(model: Model, starts: int) -> str:
    return "lbfgs" if model.convex else f"lbfgs_best_of_{starts}"


# the fields of a reference minimum's info and of each start's result (`_compute_reference`)
_INFO_FIELDS = ("optimum_method", "starts", "best_start", "lbfgs_iterations", "lbfgs_converged", "lbfgs_stop",
                "grad_norm", "plateau_decrease", "start_results")
_START_FIELDS = ("objective", "iterations", "converged", "stop", "grad_norm", "plateau_decrease")


CONVEX_GRADIENT_DROP = 1e-6  # a convex θ* must have ‖∇F‖ ≤ this × max(1, ‖∇F(θ₀)‖); L-BFGS reaches ~1e-9


def _verify(model: Model, X: np.ndarray, y: np.ndarray, starts: int, theta: np.ndarray, objective: float,
            info: Info) -> None:
    """Check a reference minimum against what defines it, recomputed from θ* and the data (~2 passes over X):
    its recorded F(θ*) and ‖∇F(θ*)‖ are what θ* gives; a convex θ* is a minimiser (the gradient has dropped by
    `CONVEX_GRADIENT_DROP` from the start θ₀); a non-convex one lies below every start (L-BFGS descends). Raises
    `diskcache.Rejected`. L* itself is always recomputed from θ* (`runner.reference_optimum`). The info (a row's
    derived values) must be what the starts give: its method and number of starts, the best start's objective F(θ*)
    (the lowest, first on ties) and its iterations."""
    inits = np.asarray(model.init(ReplicaStreams(range(starts)).generators("init")))
    with np.errstate(all="ignore"):
        value, grad = model.objective_and_gradient(theta[None], X, y)
        # the starts' objectives only where their gradients are not used (a non-convex model: the backward pass
        # is most of an MLP's evaluation)
        if model.convex:
            start_values, start_grads = model.objective_and_gradient(inits, X, y)
        else:
            start_values = model.objective(inits, X, y)
    F, g = float(value[0]), float(np.linalg.norm(grad[0]))
    if not (math.isclose(F, objective, rel_tol=1e-9, abs_tol=1e-12)
            and math.isclose(g, float(info.get("grad_norm", math.nan)), rel_tol=1e-6, abs_tol=1e-12)):
        raise diskcache.Rejected(f"its objective {objective!r} or gradient norm is not what its θ* gives "
                                 f"(F = {F!r}, ‖∇F‖ = {g:.3g})")
    if model.convex:
        bound = CONVEX_GRADIENT_DROP * max(1.0, float(np.linalg.norm(start_grads[0])))
        if not g <= bound:
            raise diskcache.Rejected(f"its θ* is not a minimiser of the convex objective "
                                     f"(‖∇F‖ = {g:.3g} > {bound:.3g})")
    elif not float(np.min(start_values)) > F:
        raise diskcache.Rejected(f"its θ* (F = {F:.6g}) is not below the L-BFGS starts "
                                 f"(F = {np.min(start_values):.6g})")
    _check_info(model, starts, objective, info)


def _disk_key(model: Model, key: CacheKey) -> dict[str, Any]:
    """Everything θ* depends on: the model and its options, the data's content (sha1 of X and y), the starts, the
    L-BFGS settings, this code's version and the libraries that compute it (NumPy, SciPy, BLAS and its CPU kernel,
    whose summation order rounds differently)."""
    name, options, digest, starts = key
    blas = sorted({(i["internal_api"], i.get("version") or "", i.get("architecture") or "")
                   for i in threadpool_info() if i.get("user_api") == "blas"})
    return {"model": name, "options": [list(o) for o in options], "data_sha1": digest, "starts": starts,
            "lbfgs": LBFGS_CONVEX if model.convex else LBFGS_NONCONVEX, "version": REFERENCE_VERSION,
            "numpy": np.__version__, "scipy": importlib.metadata.version("scipy"), "blas": [list(b) for b in blas]}


def _check_info(model: Model, starts: int, objective: float, info: Info) -> None:
    """The info is what its starts give, and each start's record of how it stopped is one the L-BFGS settings
    allow (its path is not stored: a plateau's decrease is checked against the rule, not recomputed)."""
    options = LBFGS_CONVEX if model.convex else LBFGS_NONCONVEX
    results = [info["start_results"][str(s)] for s in range(starts)]
    objectives = [r["objective"] for r in results]
    best = info["best_start"]
    plain = (all(isinstance(v, float) and math.isfinite(v) for v in objectives)
             and all(type(r["iterations"]) is int and 0 <= r["iterations"] <= options["maxiter"]
                     and r["stop"] in (*LBFGS_STOPS.values(), "abnormal")
                     and type(r["converged"]) is bool and r["converged"] is (r["stop"] == "converged")
                     and isinstance(r["grad_norm"], float) and isinstance(r["plateau_decrease"], float)
                     and math.isfinite(r["plateau_decrease"])
                     and (r["stop"] != "plateau" or (0 < options["plateau_iterations"] <= r["iterations"]
                                                     and r["plateau_decrease"] <= options["plateau_decrease"]))
                     for r in results)
             and type(best) is int and type(info["starts"]) is int and type(info["lbfgs_iterations"]) is int
             and isinstance(info["grad_norm"], float))
    if not (plain and info["optimum_method"] == _optimum_method(model, starts) and info["starts"] == starts
            and best == int(np.argmin(objectives)) and objectives[best] == objective
            and info["lbfgs_iterations"] == results[best]["iterations"]
            and info["lbfgs_converged"] is results[best]["converged"]
            and info["lbfgs_stop"] == results[best]["stop"] and info["grad_norm"] == results[best]["grad_norm"]
            and info["plateau_decrease"] == results[best]["plateau_decrease"]):
        raise diskcache.Rejected(f"its info is not what its {starts} L-BFGS start{'s' * (starts > 1)} give (method, "
                                 f"best start, its objective, iterations and how each stopped)")


def _reference_from_disk(model: Model, key: CacheKey) -> Reference | None:
    """(θ*, F(θ*), info) stored by an earlier process, bit for bit; None when absent or corrupt. Raises
    `diskcache.Rejected` for an entry with other fields than `_compute_reference` gives (an added field would
    become an `erm` row's derived value) or values of the wrong shape."""
    entry = diskcache.read_entry(diskcache.cache_folder("reference"), _disk_key(model, key), "reference")
    if entry is None:
        return None
    starts = key[3]
    entry = diskcache.exact_fields(entry, ("theta", "objective", "info"), "reference minimum")
    info = diskcache.exact_fields(entry["info"], _INFO_FIELDS, "info")
    for seed, result in diskcache.exact_fields(info["start_results"], [str(s) for s in range(starts)],
                                               "start results").items():
        diskcache.exact_fields(result, _START_FIELDS, f"start {seed}'s result")
    try:
        theta = np.array(entry["theta"], dtype=np.float64)
    except (TypeError, ValueError):
        raise diskcache.Rejected("its θ* is not a list of numbers") from None
    objective = entry["objective"]
    if not (theta.shape == (model.n_params,) and np.isfinite(theta).all() and isinstance(objective, float)):
        raise diskcache.Rejected(f"its θ* is not {model.n_params} finite numbers or its objective not a number")
    return theta, objective, info


def _reference_to_disk(model: Model, key: CacheKey, value: Reference) -> None:
    theta, objective, info = value
    diskcache.write_entry(diskcache.cache_folder("reference"), _disk_key(model, key), "reference",
                          {"theta": theta.tolist(), "objective": objective, "info": info})


class ERM(Algorithm):
    """argmin_θ F(θ) by L-BFGS (best of several starts for a non-convex model, see `reference_minimum`);
    deterministic, so every seed gets the same θ."""

    name = "erm"
    tags = Tags("ERM (exact minimiser)", private=False, batch="none")
    uses = frozenset({"l2"})
    source = "non-private empirical risk minimiser"

    def fit(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray, streams: ReplicaStreams) -> Outcome:
        theta, _, info = reference_minimum(model, X, y)
        return Outcome(np.tile(theta, (streams.replicas, 1)), info, guarantee="non-private")
