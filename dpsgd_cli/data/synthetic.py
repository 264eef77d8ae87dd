"""Synthetic linearly separable data (Song, Chaudhuri & Sarwate, GlobalSIP 2013)."""

from __future__ import annotations

import numpy as np

from dpsgd_cli.data.preprocess import STREAM_SYNTHETIC, rng

DEFAULT_N = 10_000
DEFAULT_DIM = 5
MARGIN = 1e-3


def unit_rows(X: np.ndarray) -> np.ndarray:
    """Rows of X scaled to unit L2 norm (rows of norm 0 stay 0)."""
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    return np.divide(X, norms, out=np.zeros_like(X), where=norms > 0)


def make_synthetic(n: int = DEFAULT_N, dim: int = DEFAULT_DIM, seed: int = 0,
                   margin: float = MARGIN) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X (n, dim), y (n,) in {-1, +1}, w (dim,)): points uniform on the unit sphere of R^dim (normalised
    Gaussians), labelled sign(w.x) for a random unit normal w; points with |w.x| < margin are redrawn."""
    gen = rng(seed, STREAM_SYNTHETIC)
    w = unit_rows(gen.standard_normal((1, dim)))[0]
    kept: list[np.ndarray] = []
    count = 0
    while count < n:
        batch = unit_rows(gen.standard_normal((max(n - count, 16) + 16, dim)))
        batch = batch[np.abs(batch @ w) >= margin]
        kept.append(batch)
        count += batch.shape[0]
    X = np.vstack(kept)[:n]
    y = np.where(X @ w > 0, 1.0, -1.0)
    return X, y, w
