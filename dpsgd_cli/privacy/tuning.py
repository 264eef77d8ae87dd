"""Privacy of random search with a random number of trials (Papernot & Steinke, ICLR 2022, Thms 2 and 6; Liu &
Talwar, STOC 2019); the argument, and why the validation score costs no ε: docs/hyperparameters.md."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.privacy import validate as check
from dpsgd_cli.privacy.accounting import (
    RDP_EXTENSION_ORDERS,
    Neighbours,
    _relation,
    dpsgd_event,
    quiet_rdp,
    rdp_curve_to_epsilon,
)

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent

# imported on first use (dp-accounting is slow to import): only a tuned (private selection) cell needs them
_rdp_lib = LazyModule("dp_accounting.rdp.rdp_privacy_accountant")
optimize = LazyModule("scipy.optimize")
special = LazyModule("scipy.special")

TUNING_ORDERS: tuple[float, ...] = (tuple(1 + x / 10 for x in range(1, 101)) + tuple(float(a) for a in range(12, 65))
                                    + tuple(o for o in RDP_EXTENSION_ORDERS if o <= 1024))
"""Orders of the tuned curve: (1, 11] by 0.1, every integer to 64, then ~5% apart to 1024. Tuning adds
ln E[K]/(λ − 1), so the largest orders matter only for a total ε below ~0.05 (there ε is < 2 % looser than with
orders to 4096)."""

Kind = Literal["poisson", "geometric", "logarithmic", "truncated_negative_binomial"]


@dataclass(frozen=True)
class Trials:
    """The distribution of the number of trials K: Poisson(μ), or D_{η,γ} (Papernot & Steinke §3.1)
    P[K = k] = (1 − γ)^k / (γ^{−η} − 1) · Π_{ℓ<k} (ℓ + η)/(ℓ + 1) for k ≥ 1 (η = 0: (1 − γ)^k / (k ln(1/γ)))."""

    kind: Kind
    mean: float  # E[K]
    eta: float = 1.0  # shape η of D_{η,γ} (1 for geometric, 0 for logarithmic)

    def __post_init__(self) -> None:
        check.positive("mean", self.mean)
        if self.kind != "poisson" and self.mean <= 1:
            raise UserError(f"select: mean = {self.mean:g} must be > 1 for a {self.kind} number of trials")
        if not self.eta > -1:
            raise UserError(f"select: eta = {self.eta:g} must be > -1 (Papernot & Steinke Theorem 2)")

    @property
    def shape(self) -> float:
        return math.inf if self.kind == "poisson" else self.eta

    @functools.cached_property
    def gamma(self) -> float:
        """γ of D_{η,γ} whose mean is `mean` (solved numerically; geometric: 1/mean)."""
        if self.kind == "poisson":
            raise UserError("a Poisson number of trials has no gamma")
        if self.eta == 1:
            return 1.0 / self.mean
        root: float = optimize.brentq(lambda g: tnb_mean(self.eta, g) - self.mean, 1e-15, 1 - 1e-12, xtol=1e-15,
                                      rtol=1e-14)
        return root

    def pmf(self, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, dtype=float)
        if self.kind == "poisson":
            poisson: np.ndarray = np.exp(k * math.log(self.mean) - self.mean - special.gammaln(k + 1))
            return poisson
        g, eta = self.gamma, self.eta
        if eta == 0:
            p = (1 - g) ** k / (np.maximum(k, 1) * math.log(1 / g))
        else:  # Π_{ℓ<k} (ℓ+η)/(ℓ+1) = Γ(k+η)/(Γ(η)Γ(k+1)), with its sign for η ∈ (−1, 0)
            log_ratio = special.gammaln(k + eta) - special.gammaln(eta) - special.gammaln(k + 1)
            sign = np.sign(special.poch(eta, np.maximum(k, 1)))
            p = sign * np.exp(log_ratio + k * math.log1p(-g)) / (g ** (-eta) - 1)
        pmf: np.ndarray = np.where(k >= 1, p, 0.0)
        return pmf

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """K for `size` independent searches (inverse CDF over the support, tail below 1e-12 dropped)."""
        if self.kind == "poisson":
            return rng.poisson(self.mean, size)
        top = int(self.mean * 60 + 100)
        while self.pmf(np.array([top]))[0] > 1e-16 and top < 10**7:
            top *= 2
        support = np.arange(1, top + 1)
        cdf = np.cumsum(self.pmf(support))
        return support[np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(size)), len(support) - 1)]


def tnb_mean(eta: float, gamma: float) -> float:
    """E[K] of D_{η,γ} (Papernot & Steinke, Theorem 2): η(1 − γ)/(γ(1 − γ^η)), or (1/γ − 1)/ln(1/γ) at η = 0."""
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    mean: float = eta * (1 - gamma) / (gamma * (1 - gamma**eta))
    return mean


def tnb_rdp(eps: float, lam: float, eps_hat: float, lam_hat: float, eta: float, gamma: float) -> float:
    """Papernot & Steinke Theorem 2: Q (λ, ε)- and (λ̂, ε̂)-RDP, K ~ D_{η,γ} ⇒ the best of K runs is (λ, ε')-RDP,
    ε' = ε + (1 + η)(1 − 1/λ̂)ε̂ + (1 + η) ln(1/γ)/λ̂ + ln E[K]/(λ − 1)."""
    return (eps + (1 + eta) * (1 - 1 / lam_hat) * eps_hat + (1 + eta) * math.log(1 / gamma) / lam_hat
            + math.log(tnb_mean(eta, gamma)) / (lam - 1))


def poisson_rdp(eps: float, lam: float, delta_hat: float, mu: float) -> float:
    """Papernot & Steinke Theorem 6: Q (λ, ε)-RDP and (ε̂, δ̂)-DP with e^ε̂ ≤ 1 + 1/(λ − 1), K ~ Poisson(μ) ⇒
    (λ, ε + μδ̂ + ln μ/(λ − 1))-RDP."""
    return eps + mu * delta_hat + math.log(mu) / (lam - 1)


def tuned_rdp(orders: Sequence[float], candidate_rdp: Sequence[Sequence[float]], trials: Trials) -> np.ndarray:
    """RDP curve of the best of K runs, K ~ `trials`, of Q = a uniformly drawn candidate (one RDP curve each)."""
    lams = np.asarray(orders, dtype=float)
    base = np.max(np.atleast_2d(np.asarray(candidate_rdp, dtype=float)), axis=0)
    out = np.full_like(lams, np.inf)
    if trials.kind == "poisson":
        for i, lam in enumerate(lams):
            if lam > 1:
                delta_hat = _rdp_lib.compute_delta(lams, base, math.log1p(1 / (lam - 1)))[0]
                out[i] = poisson_rdp(base[i], lam, delta_hat, trials.mean)
    else:  # Theorem 2, the best λ̂ of the grid (any λ̂ ≥ 1 is allowed)
        g, eta = trials.gamma, trials.eta
        hat = np.min((1 + eta) * ((1 - 1 / lams) * base + math.log(1 / g) / lams))
        ok = lams > 1
        out[ok] = base[ok] + hat + math.log(tnb_mean(eta, g)) / (lams[ok] - 1)
    return np.minimum.accumulate(out[::-1])[::-1]  # RDP is non-decreasing in the order


def tuned_epsilon(orders: Sequence[float], candidate_rdp: Sequence[Sequence[float]], trials: Trials,
                  delta: float) -> float:
    """(ε, δ) of the tuned mechanism: its RDP curve converted at δ (the accountant's conversion)."""
    return rdp_curve_to_epsilon(orders, tuned_rdp(orders, candidate_rdp, trials), delta)


@functools.lru_cache(maxsize=4096)
def dpsgd_rdp(sigma: float, sample_rate: float, steps: int) -> tuple[float, ...]:
    """RDP curve of DP-SGD (T Poisson-subsampled Gaussian steps, add-or-remove) on :data:`TUNING_ORDERS`."""
    accountant = _rdp_lib.RdpAccountant(list(TUNING_ORDERS))
    with quiet_rdp():
        accountant.compose(dpsgd_event(sigma, sample_rate, steps))
    return tuple(float(x) for x in accountant._rdp)  # the curve itself (the public API only converts it)


def event_rdp(event: DpEvent, neighbours: Neighbours) -> tuple[float, ...]:
    """RDP curve on :data:`TUNING_ORDERS` of any mechanism dp-accounting's RDP accountant takes, under `neighbours`
    (DP-FTRL's trees: zero-out only)."""
    accountant = _rdp_lib.RdpAccountant(list(TUNING_ORDERS), neighboring_relation=_relation(neighbours))
    with quiet_rdp():
        accountant.compose(event)
    return tuple(float(x) for x in accountant._rdp)


def liu_talwar_epsilon(epsilon: float) -> float:
    """Liu & Talwar (STOC 2019): geometric stopping over ε-DP candidates is 3ε-DP."""
    return 3.0 * check.positive("epsilon", epsilon)


def score_sigma(curve: Sequence[float]) -> float:
    """σ (in counts) of the Gaussian on the number of correct validation predictions (sensitivity 1, RDP
    α/(2σ²), Mironov 2017 Prop. 7): the smallest with α/(2σ²) ≤ curve(α) at every order of :data:`TUNING_ORDERS`."""
    per_order = np.asarray(curve, dtype=float) / np.asarray(TUNING_ORDERS)
    return float(math.sqrt(1.0 / (2.0 * per_order.min())))


def score_laplace_scale(epsilon: float) -> float:
    """Laplace scale (in counts) of the noisy validation score of a pure ε-DP candidate: ε-DP (sensitivity 1)."""
    return 1.0 / check.positive("epsilon", epsilon)
