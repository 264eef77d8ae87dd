"""Canaries and the scores an attacker computes from what it sees: `dirac` (white box, one more input coordinate
only the canary moves; per-step likelihood ratio of Nasr et al. 2023), `input` (a real record along the data's
least-used direction, black box) and `gradient` (a fixed per-example gradient, the DP-SGD analysis's worst case;
all iterates: the adversary of Nasr et al. 2021). docs/audit.md has each one's worlds, score and reach; the worlds
"in" and "out" always hold the same number of records, n + m."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dpsgd_cli.algorithms.ops import Noise, Scale, Schedule, WeightDecay
from dpsgd_cli.models import Batch, Model
from dpsgd_cli.models.base import ClipNorm, FixedGradients


def least_used_direction(X: np.ndarray) -> np.ndarray:
    """The unit vector v minimising ‖Xv‖: the eigenvector of XᵀX (d × d) with the smallest eigenvalue."""
    return np.linalg.eigh(X.T @ X)[1][:, 0]


def data_gradient_direction(model: Model, theta0: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """û = −(Σ ∇ℓ_i)/‖·‖ at θ₀: a canary gradient along it points against the data's, the worst case for a
    mechanism that clips the batch's sum (clip(S + g) − clip(S) reaches 2C instead of C)."""
    g = model.data_gradient(theta0[:1], X, y)[0]
    return -g / max(np.linalg.norm(g), 1e-300)


@dataclass
class InputCanary:
    x: np.ndarray  # (d,), unit norm, or larger where the claim rests on a clip (docs/audit.md)
    label: float   # ±1

    def score(self, model: Model, theta: np.ndarray) -> np.ndarray:
        """Margin y_c f_θ(x_c) per replica (larger when the model has fitted the canary)."""
        return self.label * model.decision(theta, self.x[None, :])[:, 0]


def input_canary(model: Model, X: np.ndarray, y: np.ndarray, reference: np.ndarray | None,
                 norm: float = 1.0) -> InputCanary:
    """The input-space canary, ‖x_c‖ = `norm`; `reference` a non-private model θ (1, P) to choose the label
    (None: +1)."""
    x = norm * least_used_direction(X)
    label = 1.0
    if reference is not None:  # the gradient norm |σ(−y f(x))|·‖∂f/∂θ‖ is largest for the label f(x) disagrees with
        label = -1.0 if model.decision(reference, x[None, :])[0, 0] > 0 else 1.0
    return InputCanary(x, label)


if TYPE_CHECKING:  # a mixin: at run time its model class comes second in the bases (`with_gradient_canaries`)
    _CanaryBase = Model
else:
    _CanaryBase = object


class _GradientCanary(_CanaryBase):
    """Mixed into a model's own class (so `isinstance`, `convex`, the Lipschitz bounds stay the model's): marker
    rows (label 0) are canaries j = 0..m−1 whose per-example gradient is raw_norm·U_j (C·U_j after clipping to
    C), added with the weight `included[r, j]` per replica (1: in; out: 0 the null record, −1 the replace-one
    mirror). Records, at every training step, the
    projections ⟨θ_t, U_j⟩ of the current iterate (R, m). The full-data paths (L-BFGS, metrics) see marker
    rows as null records: label 0, zero gradient."""

    U: np.ndarray
    included: np.ndarray
    raw_norm: float
    projections: list

    def clipped_grad_sum(self, theta: np.ndarray, batch: Batch, clip: ClipNorm) -> np.ndarray:
        if getattr(self, "_summing", False):  # the model's own per-replica split calls back in: the data alone
            return super().clipped_grad_sum(theta, batch, clip)
        self._summing = True
        try:
            g = super().clipped_grad_sum(theta, batch, clip)
        finally:
            self._summing = False
        if theta.shape[0] != self.included.shape[0]:  # a per-example call (pidp_sgd's influence test): as a record
            return g + self._canary_sum(batch, np.ones((theta.shape[0], self.U.shape[0])), clip)
        self.projections.append(theta @ self.U.T)
        return g + self._canary_sum(batch, self.included, clip)

    def fixed_gradients(self, y: np.ndarray, x_norm: np.ndarray) -> FixedGradients:
        """The marker rows as rows of fixed gradient, which the compiled steps add as `clipped_grad_sum` does (U's
        rows by their nonzeros: a Dirac canary's one coordinate) and whose projections they record."""
        rows = np.where(y == 0, self._canary_index(x_norm), -1)
        width = max(1, int(np.count_nonzero(self.U, axis=1).max()))
        idx, val = np.zeros((self.U.shape[0], width), dtype=np.int64), np.zeros((self.U.shape[0], width))
        for j, u in enumerate(self.U):
            nonzero = np.flatnonzero(u)
            idx[j, :nonzero.size], val[j, :nonzero.size] = nonzero, u[nonzero]
        return FixedGradients(rows, idx, val, self.included, self.raw_norm, self.projections.append)

    def _canary_sum(self, batch: Batch, included: np.ndarray, clip: ClipNorm):
        marker = (batch.y == 0) & (batch.weight > 0)
        if not marker.any():
            return 0.0
        j = self._canary_index(batch.x_norm)
        counts = np.zeros(included.shape)
        rows, cols = np.nonzero(marker)
        np.add.at(counts, (rows, j[rows, cols]), batch.weight[rows, cols])
        return self._norm(clip) * (counts * included) @ self.U

    def _canary_index(self, x_norm: np.ndarray) -> np.ndarray:
        m = self.U.shape[0]
        return np.clip(np.rint(x_norm * (m + 1)).astype(int) - 1, 0, m - 1)

    def _norm(self, clip: ClipNorm) -> float | np.ndarray:
        return self.raw_norm if clip is None else np.minimum(self.raw_norm, clip)


def marker_rows(m: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """m marker rows: x = e₀·(j + 1)/(m + 1) (the norm says which canary), label 0."""
    X = np.zeros((m, d))
    X[:, 0] = (np.arange(m) + 1) / (m + 1)
    return X, np.zeros(m)


def with_gradient_canaries(model: Model, directions: np.ndarray, included: np.ndarray,
                           raw_norm: float) -> _GradientCanary:
    """A copy of `model` whose marker rows are gradient canaries (see `_GradientCanary`)."""
    cls: type[_GradientCanary] = type(f"GradientCanary{type(model).__name__}", (_GradientCanary, type(model)), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(model.__dict__)
    wrapped.U, wrapped.included = np.atleast_2d(directions), np.asarray(included, dtype=float)
    wrapped.raw_norm, wrapped.projections = float(raw_norm), []
    return wrapped


@dataclass
class GradientScores:
    last_iterate: np.ndarray                  # (R, m): −⟨θ_T, U_j⟩
    all_iterates: np.ndarray                  # (R, m): max_t |Δa_t − Δa_{t−1}|, a_t = ⟨θ_t, U_j⟩ (or signed)
    steps: int = 0
    extra: dict = field(default_factory=dict)


def gradient_scores(model: _GradientCanary, theta_final: np.ndarray, signed: bool = False) -> GradientScores:
    """`signed` (the out world holds the mirror −C·u, replace-one): the all-iterates score must tell +C·u from −C·u,
    which |jumps| cannot: it is −e_t* at the step t* where |e_t| is largest, e_t = Δa_t − (Δa_{t−1} + Δa_{t+1})/2
    the update's departure from its neighbours' (the canary's step stands out by C·η_t, its neighbours by half)."""
    blocks = [*model.projections, theta_final @ model.U.T]  # (R, m) per step, or (k, R, m) from the kernel
    a = np.concatenate([np.reshape(b, (-1, *b.shape[-2:])) for b in blocks])  # (T + 1, R, m)
    updates = np.diff(a, axis=0)
    if signed:
        return GradientScores(-a[-1], _signed_departure(updates), steps=updates.shape[0])
    jumps = np.abs(np.diff(updates, axis=0)).max(axis=0) if updates.shape[0] >= 2 else np.zeros(a.shape[1:])
    return GradientScores(-a[-1], jumps, steps=updates.shape[0])


def _signed_departure(updates: np.ndarray) -> np.ndarray:
    """(R, m): −e_t* (see `gradient_scores`); the ends are compared with their one neighbour (reflection)."""
    if updates.shape[0] < 2:
        return -updates.sum(axis=0)
    padded = np.pad(updates, ((1, 1), (0, 0), (0, 0)), mode="reflect")
    e = padded[1:-1] - (padded[:-2] + padded[2:]) / 2
    t = np.abs(e).argmax(axis=0)[None]
    return -np.take_along_axis(e, t, axis=0)[0]


# --- the Dirac canary ----------------------------------------------------------------------------------------------

def dirac_index(model: Model) -> int:
    """The parameter fed only by the last input coordinate: logistic regression's weight d − 1, the MLP's first
    hidden unit's weight from input d − 1 (W1 is stored (h, d) row-major, so also index d − 1)."""
    return model.d - 1


@dataclass(frozen=True)
class StepModel:
    """How one update moves the canary's coordinate a_t: Δa_t = −η_t (F·c·b_t + λ a_t + ν z_t), b_t the
    canary's inclusion (0/1, or −1 for a replace-one mirror), z_t standard normal. `q`: the chance that a step
    holds the canary (1: every step)."""

    schedule: Schedule  # t ↦ η_t (t = 1, 2, ...)
    F: float          # the product of the scales applied to the gradient sum
    c: float          # the canary's gradient norm after clipping
    lam: float        # the weight decay's coefficient on the update
    nu: float         # the noise's std on the update (before η)
    q: float

    @property
    def sigma(self) -> float:
        """The noise in units of one inclusion's effect: the mechanism's noise multiplier on this coordinate."""
        return self.nu / (self.F * self.c)


def step_model(chain, canary_norm: float, q: float) -> StepModel:
    """Read the update's linear structure off a chain's ops (noise, scale, weight decay). Ops it does not know
    (smoothing) and a projection are left out: the statistic stays a fixed function of the iterates (so every
    bound stays valid), only its power may drop."""
    F, lam, nu = 1.0, 0.0, 0.0
    for op in chain.ops:
        if isinstance(op, Scale):
            F, lam, nu = F * op.factor, lam * op.factor, nu * op.factor
        elif isinstance(op, Noise):
            nu = float(np.hypot(nu, op.std))
        elif isinstance(op, WeightDecay):
            lam += op.l2
    return StepModel(chain.schedule, F, canary_norm, lam, nu, q)


def step_statistics(a: np.ndarray, steps: StepModel) -> np.ndarray:
    """x_t = −(Δa_t/η_t + λ a_t)/(F c) = b_t + σ z_t per step (T, R): the canary's inclusions in noise."""
    eta = np.array([steps.schedule(t) for t in range(1, a.shape[0])])[:, None]
    return -(np.diff(a, axis=0) / eta + steps.lam * a[:-1]) / (steps.F * steps.c)


def step_likelihood_ratio(x: np.ndarray, sigma: float, q: float, mirror: bool = False,
                          sigma_floor: float = 1e-3) -> np.ndarray:
    """Σ_t of the log-likelihood ratio of "in" against "out" for x_t = b_t + σ z_t (R,): with μ = 1/σ and
    v_t = x_t/σ, Σ_t log(1 − q + q·exp(μ v_t − μ²/2)) (Nasr et al. 2023, Poisson sampling); q = 1: Σ_t x_t, to
    which it is monotone. `mirror`: the out world holds the canary's mirror (b_t = −1 w.p. q), the ratio of
    the two mixtures. σ below `sigma_floor` (no noise) is taken as the floor: the ratio stays finite."""
    s = max(float(sigma), sigma_floor)
    if q >= 1:
        return x.sum(axis=0)
    log_q, log_1q = np.log(q), np.log1p(-q)
    inn = np.logaddexp(log_1q, log_q + (x - 0.5) / s**2)
    if mirror:
        return (inn - np.logaddexp(log_1q, log_q + (-x - 0.5) / s**2)).sum(axis=0)
    return inn.sum(axis=0)


def iterate_projections(model: _GradientCanary, theta_final: np.ndarray) -> np.ndarray:
    """a_t = ⟨θ_t, U_0⟩ for t = 0..T (T + 1, R): recorded before every step, and the released θ_T."""
    blocks = [*model.projections, theta_final @ model.U.T]
    return np.concatenate([np.reshape(b, (-1, *b.shape[-2:])) for b in blocks])[:, :, 0]
