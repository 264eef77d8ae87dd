"""Figure: Rényi DP of noisy GD against the number of steps K — privacy dynamics vs composition vs lower bound,
the comparison of Chourasia, Ye & Shokri (NeurIPS 2021), Figure 1."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from dpsgd_cli.engine.folder import save_figure, write_text  # noqa: E402
from dpsgd_cli.errors import UserError  # noqa: E402
from dpsgd_cli.plots.layout import caption_text, finish  # noqa: E402

COLUMNS = ("K", "dynamics", "composition", "lower_bound")
LINES = {
    "composition": (r"composition of $K$ Gaussian steps: $\alpha\eta K S_g^2/(4\sigma^2 n^2)$", "tab:red", "-"),
    "dynamics": (r"privacy dynamics (Chourasia et al.): "
                 r"$\frac{\alpha S_g^2}{\lambda\sigma^2 n^2}(1 - e^{-\lambda\eta K/2})$", "tab:blue", "-"),
    "lower_bound": (r"lower bound, $\frac{1}{2}\Vert\theta - x\Vert^2$ loss: "
                    r"$\frac{\alpha S_g^2}{4\sigma^2 n^2}(1 - e^{-\eta K})$", "tab:green", "--"),
}


def k_values(k_max: int, points: int = 200, log: bool = False) -> np.ndarray:
    """Integers 1..k_max (both included), about `points` of them, evenly spread (on a log scale if `log`)."""
    if k_max < 1 or points < 2:
        raise UserError(f"need k_max ≥ 1 and points ≥ 2, got k_max = {k_max}, points = {points}")
    spread = np.geomspace if log else np.linspace
    return np.unique(np.round(spread(1, k_max, points))).astype(int)


def plot_privacy_curve(frame: pd.DataFrame, path: Path, log_x: bool = False, log_y: bool = False,
                       caption: bool = True) -> Path:
    """Draw ε(α) against K for the columns of `privacy_curve(...)`; parameters from frame.attrs in the caption
    (written to a .txt beside the figure instead when `caption` is False)."""
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise UserError(f"privacy curve frame lacks columns {missing}; build it with "
                        f"dpsgd_cli.privacy.dynamics.privacy_curve")
    path = Path(path)
    frame = frame.sort_values("K")
    attrs = frame.attrs
    fig, ax = plt.subplots(figsize=(7.0, 3.8), dpi=150)
    for column, (label, color, style) in LINES.items():
        if frame[column].isna().all():  # the lower bound at λ ≠ 1 (see privacy_curve)
            continue
        ax.plot(frame["K"], frame[column], style, color=color, label=label, lw=1.8)
    if "saturation" in attrs:
        ax.axhline(attrs["saturation"], color="tab:blue", ls=":", lw=1,
                   label=r"dynamics limit $\alpha S_g^2/(\lambda\sigma^2 n^2)$ = " + f"{attrs['saturation']:.3g}")
    if log_x:
        ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("number of noisy GD steps $K$")
    alpha = attrs.get("alpha")
    ax.set_ylabel(r"Rényi DP $\varepsilon(\alpha)$" + (f" at $\\alpha$ = {alpha:g}" if alpha is not None else ""))
    ax.grid(True, which="both", alpha=0.3)
    keys = [("alpha", r"\alpha"), ("sigma", r"\sigma"), ("sensitivity", "S_g"), ("eta", r"\eta"), ("lam", r"\lambda"),
            ("n", "n")]
    params = ", ".join(f"${sym}$ = {attrs[k]:g}" for k, sym in keys if k in attrs)
    phrases = [r"noisy GD $\theta \leftarrow \Pi(\theta - \eta\nabla L_D(\theta) + \sqrt{2\eta\sigma^2}\,N(0, I))$",
               "replace-one neighbours", "Chourasia, Ye & Shokri, NeurIPS 2021", *([params] if params else []),
               r"composition is the smaller bound while $\lambda\eta K/2 < 1.594$, then the dynamics bound "
               "(it saturates)",
               attrs.get("lower_bound_note", r"at $\lambda = 1$ the dynamics bound is 2-4 times the lower bound (the "
                                             "talk: \"up to a small constant of 4\")")]
    finish(fig, title=attrs.get("title", "Noisy GD: Rényi privacy loss over iterations"),
           caption=phrases if caption else [], legend_size=8)
    save_figure(fig, path, dpi=150)
    if not caption:
        write_text(path.with_suffix(".txt"), caption_text(phrases))
    plt.close(fig)
    return path
