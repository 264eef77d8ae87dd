"""Figure: Rényi DP of noisy GD against the number of steps K — privacy dynamics vs composition vs lower bound.

Reproduces the comparison of Chourasia, Ye & Shokri (NeurIPS 2021), Figure 1, from
:func:`dpsgd_cli.privacy.dynamics.privacy_curve`.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from dpsgd_cli.errors import UserError  # noqa: E402

COLUMNS = ("K", "dynamics", "composition", "lower_bound")
LINES = {
    "composition": ("composition of K Gaussian steps: αηKS_g²/(4σ²n²)", "tab:red", "-"),
    "dynamics": ("privacy dynamics (Chourasia et al.): αS_g²/(λσ²n²)·(1 − exp(−ληK/2))", "tab:blue", "-"),
    "lower_bound": ("lower bound, ½‖θ−x‖² loss: αS_g²/(4σ²n²)·(1 − exp(−ηK))", "tab:green", "--"),
}


def k_values(k_max: int, points: int = 200, log: bool = False) -> np.ndarray:
    """Integers 1..k_max (both included), about `points` of them, evenly spread (on a log scale if `log`)."""
    if k_max < 1 or points < 2:
        raise UserError(f"need k_max ≥ 1 and points ≥ 2, got k_max = {k_max}, points = {points}")
    spread = np.geomspace if log else np.linspace
    return np.unique(np.round(spread(1, k_max, points))).astype(int)


def plot_privacy_curve(frame: pd.DataFrame, path: Path, log_x: bool = False, log_y: bool = False) -> Path:
    """Draw ε(α) against K for the columns of `privacy_curve(...)`; parameters from frame.attrs in the caption."""
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise UserError(f"privacy curve frame lacks columns {missing}; build it with "
                        f"dpsgd_cli.privacy.dynamics.privacy_curve")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = frame.sort_values("K")
    attrs = frame.attrs
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    for column, (label, color, style) in LINES.items():
        if frame[column].isna().all():  # the lower bound at λ ≠ 1 (see privacy_curve)
            continue
        ax.plot(frame["K"], frame[column], style, color=color, label=label, lw=1.8)
    if "saturation" in attrs:
        ax.axhline(attrs["saturation"], color="tab:blue", ls=":", lw=1,
                   label=f"dynamics limit αS_g²/(λσ²n²) = {attrs['saturation']:.3g}")
    if log_x:
        ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("number of noisy GD steps K")
    alpha = attrs.get("alpha")
    ax.set_ylabel(f"Rényi DP ε(α){f' at α = {alpha:g}' if alpha is not None else ''}")
    ax.set_title("Noisy GD: Rényi privacy loss vs iterations")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    keys = [("alpha", "α"), ("sigma", "σ"), ("sensitivity", "S_g"), ("eta", "η"), ("lam", "λ"), ("n", "n")]
    params = ", ".join(f"{sym} = {attrs[k]:g}" for k, sym in keys if k in attrs)
    caption = ("Noisy GD θ ← Π(θ − η∇L_D(θ) + √(2ησ²)·N(0, I)), replace-one neighbours; Chourasia, Ye & Shokri, "
               "NeurIPS 2021.\n" + (f"{params}.\n" if params else "")
               + "Composition is the smaller bound while ληK/2 < 1.594; the dynamics bound saturates.\n"
               + attrs.get("lower_bound_note", "At λ = 1 the dynamics bound is 2-4 times the lower bound (the talk: "
                                               "\"up to a small constant of 4\")."))
    fig.text(0.01, 0.01, caption, fontsize=7.5, va="bottom", ha="left")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path
