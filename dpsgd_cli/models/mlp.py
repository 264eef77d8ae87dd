"""One-hidden-layer perceptron (Kang et al.), vectorised over the replica axis; θ is flat, (R, P), laid out as
[W₁ (h×d, row-major) | b₁ (h) | w₂ (h) | b₂ (1)]. Gradients, clipping and the R-operator: docs/algorithms.md#models."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy.special import expit

from dpsgd_cli.compiled import optional_compiled
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.models.base import Batch, ClipNorm, Model, logistic_loss
from dpsgd_cli.models.rows import IndexedBatch, RowNonzeros

sparse = LazyModule("scipy.sparse")  # only for full-batch optimisation (`full_batch_rows`)

Activation = Literal["tanh", "relu", "sigmoid"]
# Full-data passes are cut into blocks of examples so that an (R, block, h) temporary holds at most this many numbers.
BLOCK_ELEMENTS = 1 << 22
# Full-batch optimisation reads X as a CSR matrix when at most this fraction of it is nonzero: the one-hot grids
# (adult: 13% nonzero) then cost ~nnz·h per product instead of n·d·h
SPARSE_DENSITY = 0.2


class MLPOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    hidden: int | None = Field(None, ge=1, description="hidden units h (default: the input dimension d)")
    activation: Activation = Field("tanh", description="φ: tanh (smooth, default), relu or sigmoid")


# (R, M, h) arrays updated in place: a fresh one costs page faults (~1 ms, as much as a matmul), and `1.0 - a * a`
# a NumPy check whether it may elide the temporary (a C backtrace, ~2 ms)
def _activate(kind: str, z: np.ndarray, derivative: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """(φ(z), φ'(z) or None without `derivative`); overwrites z with φ(z)."""
    if kind == "tanh":
        a = np.tanh(z, out=z)
        if not derivative:
            return a, None
        da = np.multiply(a, a)
        np.subtract(1.0, da, out=da)
        return a, da
    if kind == "sigmoid":
        a = expit(z, out=z)
        if not derivative:
            return a, None
        da = np.subtract(1.0, a)
        da *= a
        return a, da
    if kind == "relu":
        da = (z > 0).astype(z.dtype) if derivative else None
        return np.maximum(z, 0.0, out=z), da
    raise ValueError(f"unknown activation {kind!r}")


def _second_derivative(kind: str, a: np.ndarray, da: np.ndarray) -> np.ndarray:
    """φ''(z) from φ(z) and φ'(z) (0 for relu, almost everywhere)."""
    if kind == "tanh":  # −2 tanh (1 − tanh²)
        out = np.multiply(a, da)
        out *= -2.0
        return out
    if kind == "sigmoid":  # σ'(1 − 2σ)
        out = np.multiply(a, -2.0)
        out += 1.0
        out *= da
        return out
    return np.zeros_like(a)


class MLP(Model):
    """d → h (φ) → 1 logit, logistic loss; non-convex, so no global Lipschitz or smoothness bound (None). `X` may be
    shared (n, d) or per replica (R, M, d) in every method."""

    name = "mlp"
    Options = MLPOptions
    convex = False

    def __init__(self, d: int, l2: float, hidden: int | None = None, activation: Activation = "tanh"):
        super().__init__(d, l2)
        self.hidden = int(hidden) if hidden is not None else int(d)
        self.activation = activation
        _activate(activation, np.zeros(1))  # validates the name

    # Parameters -----------------------------------------------------------------------------------------
    @property
    def n_params(self) -> int:
        return self.d * self.hidden + 2 * self.hidden + 1

    def unpack(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Views (W₁ (R, h, d), b₁ (R, h), w₂ (R, h), b₂ (R,)) of θ (R, P)."""
        d, h = self.d, self.hidden
        if theta.shape[-1] != self.n_params:
            raise ValueError(f"mlp with d = {d}, h = {h} has P = {self.n_params} parameters, got {theta.shape[-1]}")
        R = theta.shape[0]
        W1 = theta[:, : d * h].reshape(R, h, d)
        b1 = theta[:, d * h: d * h + h]
        w2 = theta[:, d * h + h: d * h + 2 * h]
        b2 = theta[:, -1]
        return W1, b1, w2, b2

    def pack(self, W1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray) -> np.ndarray:
        """θ (R, P) from (W₁ (R, h, d), b₁ (R, h), w₂ (R, h), b₂ (R,))."""
        R = W1.shape[0]
        return np.concatenate([W1.reshape(R, -1), b1, w2, np.reshape(b2, (R, 1))], axis=1)

    def init(self, generators: Sequence[np.random.Generator]) -> np.ndarray:
        d, h = self.d, self.hidden
        if self.activation == "relu":  # He et al. 2015
            lim1, lim2 = np.sqrt(6.0 / d), np.sqrt(6.0 / h)
        else:  # Glorot & Bengio 2010
            lim1, lim2 = np.sqrt(6.0 / (d + h)), np.sqrt(6.0 / (h + 1))
        rows = []
        for g in generators:  # one replica's draws from its own generator
            W1 = g.uniform(-lim1, lim1, size=(1, h, d))
            w2 = g.uniform(-lim2, lim2, size=(1, h))
            rows.append(self.pack(W1, np.zeros((1, h)), w2, np.zeros(1))[0])
        return np.stack(rows) if rows else np.zeros((0, self.n_params))

    def full_batch_rows(self, X: np.ndarray) -> Any:
        """X (n, d) as a scipy CSR matrix when at most `SPARSE_DENSITY` of it is nonzero, else X: what
        `objective_and_gradient` reads fastest over many full-batch passes. The same math; the products sum in
        another order (results within ~1e-15 relative of the dense ones)."""
        if X.ndim != 2 or np.count_nonzero(X) > SPARSE_DENSITY * X.size:
            return X
        return sparse.csr_matrix(X)

    # Forward / backward ----------------------------------------------------------------------------------
    def _blocks(self, X: np.ndarray, replicas: int) -> Iterator[slice]:
        m = X.shape[-2]
        size = max(1, BLOCK_ELEMENTS // max(1, replicas * self.hidden))
        for start in range(0, m, size):
            yield slice(start, min(m, start + size))

    def _forward(self, theta: np.ndarray, X: np.ndarray):
        """(a, φ'(z), f) for X (n, d) or (R, M, d): a, φ' (R, M, h); f (R, M)."""
        W1, b1, w2, b2 = self.unpack(theta)
        if isinstance(X, np.ndarray):
            z = np.matmul(X, W1.transpose(0, 2, 1))
        else:  # CSR (m, d) (`full_batch_rows`): X·W₁ᵀ replica by replica
            z = np.stack([X @ W.T for W in W1])
        z += b1[:, None, :]
        return self._head(theta, z)

    def _head(self, theta: np.ndarray, z: np.ndarray):
        """(a, φ'(z), f) from the hidden pre-activations z (R, M, h) (overwritten with a)."""
        W1, b1, w2, b2 = self.unpack(theta)
        a, da = _activate(self.activation, z)
        f = np.matmul(a, w2[:, :, None])[..., 0] + b2[:, None]
        return a, da, f

    def decision(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        R = theta.shape[0]
        return np.concatenate([self._forward(theta, X[..., s, :])[2] for s in self._blocks(X, R)], axis=-1)

    def data_loss(self, theta, X, y):
        return logistic_loss(self.decision(theta, X), y)

    def _backward(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray, weight,
                  clip: ClipNorm, x_norm) -> tuple[np.ndarray, np.ndarray]:
        """(Σ_i weight_i · min(1, C/‖∇ℓ_i‖) ∇ℓ_i (R, P), Σ_i weight_i ℓ_i (R,)), examples in blocks."""
        out = np.zeros_like(theta)
        gW1 = self.unpack(out)[0]
        loss = np.zeros(theta.shape[0])
        for k, s in enumerate(self._blocks(X, theta.shape[0])):
            Xs = X[..., s, :] if isinstance(X, np.ndarray) else X[s]
            w = weight[..., s] if np.ndim(weight) else weight
            delta, coef, a = self._accumulate(theta, self._forward(theta, Xs), y[..., s], w, clip,
                                              None if x_norm is None else x_norm[..., s], loss)
            self._add_sums(delta, coef, a, out)
            if not isinstance(Xs, np.ndarray):  # CSR: (Xsᵀ δ_r)ᵀ, Xsᵀ a CSC view
                for r in range(theta.shape[0]):
                    gW1[r] += (Xs.T @ delta[r]).T
            elif k == 0:  # straight into the output's W₁ block (a strided view; NumPy handles it)
                np.matmul(delta.transpose(0, 2, 1), Xs, out=gW1)
            else:
                gW1 += np.matmul(delta.transpose(0, 2, 1), Xs)
        return out, loss

    def _accumulate(self, theta: np.ndarray, forward, y: np.ndarray, w, clip: ClipNorm, x_norm,
                    loss: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(δ (R, m, h), coef (R, m), a (R, m, h)): each example's clipped, weighted ∂ℓ/∂z and ∂ℓ/∂f, and its
        activations; adds the weighted losses to `loss` unless None."""
        a, u, f = forward
        w2 = self.unpack(theta)[2]
        if loss is not None:
            loss += np.sum(w * np.logaddexp(0.0, -y * f), axis=-1)
        u *= w2[:, None, :]  # φ'(z) ⊙ w₂ = ∂f/∂z, (R, m, h)
        norms = None if clip is None else (np.einsum("rmh,rmh->rm", a, a), np.einsum("rmh,rmh->rm", u, u))
        coef = _coefficients(y, f, w, clip, x_norm, norms)
        delta = u
        delta *= coef[..., None]  # (R, m, h): each example's clipped, weighted δ
        return delta, coef, a

    def _add_sums(self, delta: np.ndarray, coef: np.ndarray, a: np.ndarray, out: np.ndarray) -> None:
        """Adds the examples' gradients of b₂, w₂, b₁ (Σ coef, Σ coef·a, Σ δ) to `out`."""
        gW1, gb1, gw2, gb2 = self.unpack(out)
        gb2 += coef.sum(axis=-1)
        gw2 += np.matmul(coef[:, None, :], a)[:, 0, :]
        gb1 += delta.sum(axis=1)

    def data_gradient(self, theta, X, y):
        return self._backward(theta, X, y, 1.0 / X.shape[-2], None, None)[0]

    def data_loss_and_gradient(self, theta, X, y):
        grad, loss = self._backward(theta, X, y, 1.0 / X.shape[-2], None, None)
        return loss, grad

    def reads_rows_compiled(self, batch: Batch, theta: np.ndarray) -> bool:
        return _row_sparse(batch, theta) is not None

    def clipped_grad_sum(self, theta, batch: Batch, clip: ClipNorm):
        sparse = _row_sparse(batch, theta)
        if sparse is None:  # the dense path's BLAS products round by M: replica by replica where M differs
            split = self._clipped_grad_sum_per_replica(theta, batch, clip)
            return split if split is not None else \
                self._backward(theta, batch.X, batch.y, batch.weight, clip, batch.x_norm)[0]
        kernels, nz, batch_rows = sparse
        W1, b1, w2, b2 = self.unpack(theta)
        R, (M, h, d) = theta.shape[0], (batch_rows.shape[1], self.hidden, self.d)
        packed = _scratch("rows", (*batch_rows.shape, nz.packed.shape[1]), nz.packed.dtype)
        # the batch's nonzeros, gathered by NumPy (see _mlp_numba); the rows are valid, and mode "raise" would copy
        rows = nz.split(np.take(nz.packed, batch_rows, axis=0, out=packed, mode="clip"))
        z, u = _scratch("z", (R, M, h), theta.dtype), _scratch("u", (R, M, h), theta.dtype)
        kernels.hidden(*rows, np.ascontiguousarray(W1.transpose(0, 2, 1)), np.ascontiguousarray(b1), z)
        a = _activate(self.activation, z, derivative=False)[0]
        f, aa, uu = (np.empty((R, M), theta.dtype) for _ in range(3))
        kernels.row_terms(a, kernels.ACTIVATIONS[self.activation], theta.dtype.type(1), np.ascontiguousarray(w2),
                          np.ascontiguousarray(b2), u, f, aa, uu)  # u = φ'(z) ⊙ w₂
        if clip is None or np.ndim(clip) or any(np.asarray(v).dtype != theta.dtype
                                                for v in (batch.y, batch.weight, batch.x_norm)):
            coef = _coefficients(batch.y, f, batch.weight, clip, batch.x_norm, (aa, uu))
        else:  # _coefficients' operations after expit in one compiled pass, the same numbers (all in θ's dtype)
            minus_y = np.negative(batch.y)
            coef = np.empty_like(f)
            kernels.clipped_coefficients(minus_y, expit(minus_y * f), batch.weight, batch.x_norm, aa, uu,
                                         theta.dtype.type(1), theta.dtype.type(clip), coef)
        G, gb1, gw2, gb2 = (_scratch("G", (R, d, h), theta.dtype), np.empty((R, h), theta.dtype),
                            np.empty((R, h), theta.dtype), np.empty(R, theta.dtype))
        kernels.backward(*rows, u, np.ascontiguousarray(coef, dtype=theta.dtype), a, G, gb1, gw2, gb2)
        out = np.empty_like(theta)
        oW1, ob1, ow2, ob2 = self.unpack(out)
        np.copyto(oW1, G.transpose(0, 2, 1))
        ob1[...], ow2[...], ob2[...] = gb1, gw2, gb2
        return out

    def per_example_grad_norms(self, theta, batch: Batch):
        W1, b1, w2, b2 = self.unpack(theta)
        a, da, f = self._forward(theta, batch.X)
        r = -batch.y * expit(-batch.y * f)
        u = da * w2[:, None, :]
        return np.abs(r) * np.sqrt(1.0 + np.einsum("rmh,rmh->rm", a, a)
                                   + np.einsum("rmh,rmh->rm", u, u) * (batch.x_norm**2 + 1.0))

    # The output layer: a logistic regression on ã = [φ(W₁x + b₁), 1] with parameters [w₂, b₂] ----------------
    def output_features(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        """ã = [φ(W₁x + b₁), 1] for the rows of X (m, d): (R, m, h + 1); f(x) = ã·[w₂, b₂]."""
        W1, b1, _, _ = self.unpack(theta)
        z = np.matmul(X, W1.transpose(0, 2, 1))
        z += b1[:, None, :]
        a, _ = _activate(self.activation, z, derivative=False)
        return np.concatenate([a, np.ones(a.shape[:-1] + (1,))], axis=-1)

    def output_layer_params(self, theta: np.ndarray) -> np.ndarray:
        """[w₂, b₂] (R, h + 1): the last h + 1 entries of θ."""
        _, _, w2, b2 = self.unpack(theta)
        return np.concatenate([w2, b2[:, None]], axis=1)

    def output_feature_bound(self, theta: np.ndarray) -> np.ndarray:
        """A_r ≥ ‖ã‖ for every ‖x‖ ≤ 1: (R,). tanh, sigmoid: |φ| ≤ 1, so A = √(h + 1) for every θ. relu:
        ‖φ(W₁x + b₁)‖ ≤ ‖[W₁ b₁][x; 1]‖ ≤ √2 ‖[W₁ b₁]‖₂, so A = √(1 + 2‖[W₁ b₁]‖₂²) at θ's hidden layer."""
        if self.activation in ("tanh", "sigmoid"):
            return np.full(theta.shape[0], math.sqrt(self.hidden + 1.0))
        W1, b1, _, _ = self.unpack(theta)
        spectral = np.linalg.norm(np.concatenate([W1, b1[:, :, None]], axis=2), ord=2, axis=(1, 2))
        return np.sqrt(1.0 + 2.0 * spectral**2)

    # Second order -----------------------------------------------------------------------------------------
    def hvp(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Exact ∇²F(θ) v (R-operator, docs/algorithms.md#models), λv included: (R, P)."""
        W1, b1, w2, b2 = self.unpack(theta)
        V1, c1, v2, c2 = self.unpack(v)
        R, n = theta.shape[0], X.shape[-2]
        hW1, hb1, hw2, hb2 = np.zeros_like(W1), np.zeros_like(b1), np.zeros_like(w2), np.zeros_like(b2)
        for s in self._blocks(X, R):
            Xs = X[..., s, :]
            a, da, f = self._forward(theta, Xs)
            ys = y[..., s]
            r = -ys * expit(-ys * f)
            curvature = expit(f) * expit(-f)  # ℓ''(f)
            Rz = np.matmul(Xs, V1.transpose(0, 2, 1))
            Rz += c1[:, None, :]
            Ra = da * Rz
            Rf = np.matmul(a, v2[:, :, None])[..., 0] + np.matmul(Ra, w2[:, :, None])[..., 0] + c2[:, None]
            Rr = curvature * Rf
            # R{δ} = φ' ⊙ (R{r} w₂ + r v₂) + r w₂ ⊙ φ'' ⊙ R{z}
            Rdelta = Rr[..., None] * w2[:, None, :]
            Rdelta += r[..., None] * v2[:, None, :]
            Rdelta *= da
            if self.activation != "relu":
                second = _second_derivative(self.activation, a, da)
                second *= Rz
                second *= r[..., None] * w2[:, None, :]
                Rdelta += second
            hb2 += Rr.sum(axis=-1)
            hw2 += np.matmul(Rr[:, None, :], a)[:, 0, :] + np.matmul(r[:, None, :], Ra)[:, 0, :]
            hb1 += Rdelta.sum(axis=1)
            hW1 += np.matmul(Rdelta.transpose(0, 2, 1), Xs)
        out = self.pack(hW1, hb1, hw2, hb2)
        out /= n
        out += self.l2 * v
        return out


def _coefficients(y: np.ndarray, f: np.ndarray, w, clip: ClipNorm, x_norm, norms) -> np.ndarray:
    """coef (R, m) = weight · ∂ℓ/∂f · min(1, C/‖∇ℓ‖) (no clip when C is None), with
    ‖∇ℓ‖² = r²(1 + ‖a‖² + ‖u‖²(‖x‖² + 1)) from norms = (‖a‖², ‖u‖²) (R, m)."""
    r = -y * expit(-y * f)  # ∂ℓ/∂f, (R, m)
    coef = r * w
    if clip is not None:
        aa, uu = norms
        norm = np.abs(r) * np.sqrt(1.0 + aa + uu * (x_norm * x_norm + 1.0))
        coef = coef * (clip / np.maximum(norm, clip))  # = min(1, C/‖g‖), safe at ‖g‖ = 0
    return coef


_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array, the same memory at every call with this name in this thread: fresh
    MB-sized temporaries each step cost ~90 page faults (~4% of the MLP's step at R = 10)."""
    size = math.prod(shape)
    pool: dict[tuple[str, np.dtype], np.ndarray] = _SCRATCH.__dict__.setdefault("pool", {})
    buffer = pool.get((name, np.dtype(dtype)))
    if buffer is None or buffer.size < size:
        buffer = pool[(name, np.dtype(dtype))] = np.empty(size, dtype)
    return buffer[:size].reshape(shape)


def _row_sparse(batch: Batch, theta: np.ndarray) -> tuple[Any, RowNonzeros, np.ndarray] | None:
    """(the numba kernels, the data's `RowNonzeros`, the batch's rows (R, M)) when the batch may be read row-sparse
    (an `IndexedBatch` of sparse enough rows, θ of the data's dtype, numba importable); else None."""
    if not isinstance(batch, IndexedBatch):
        return None
    nz = batch.nonzeros()
    if nz is None or nz.dtype != theta.dtype:
        return None
    kernels = optional_compiled("models._mlp_numba")  # None: NumPy gives the same numbers up to summation order
    return None if kernels is None else (kernels, nz, batch.rows)
