"""Claimed ε against the audit's ε_lo, a panel per threat model, the diagonal ε_lo = ε; refuted claims stand out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd


def plot_audit(frame: pd.DataFrame, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = frame[(frame["status"] == "ok") & frame["epsilon_lo"].notna()]
    if ok.empty:
        return []
    threats = sorted(ok["threat_model"].unique())
    fig, axes = plt.subplots(1, len(threats), figsize=(5 * len(threats), 4.4), squeeze=False)
    algorithms = sorted(ok["algorithm"].unique())
    colors = {a: plt.cm.tab10(i % 10) for i, a in enumerate(algorithms)}
    top = float(np.nanmax([ok["epsilon_claimed"].max(), ok["epsilon_lo"].max()])) * 1.15
    for ax, threat in zip(axes[0], threats):
        part = ok[ok["threat_model"] == threat]
        ax.plot([0, top], [0, top], color="0.4", lw=1, ls="--", label="ε_lo = ε (above: refuted)")
        ax.fill_between([0, top], [0, top], [top, top], color="tab:red", alpha=0.07)
        for algo, group in part.groupby("algorithm"):
            refuted = group["epsilon_lo"] > group["epsilon_claimed"]
            ax.scatter(group["epsilon_claimed"][~refuted], group["epsilon_lo"][~refuted], color=colors[algo],
                       label=algo, s=30)
            ax.scatter(group["epsilon_claimed"][refuted], group["epsilon_lo"][refuted], color=colors[algo],
                       marker="X", s=110, edgecolor="red", linewidth=1.5, zorder=5,
                       label=f"{algo}: REFUTED" if refuted.any() else None)
        ax.set(xlim=(0, top), ylim=(0, top), xlabel="claimed ε (accountant)", ylabel="audited lower bound ε_lo",
               title=threat)
        ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    fig.suptitle("Privacy audit: claimed ε vs empirical lower bound", fontsize=11)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "audit.png", folder / "audit.pdf"]
    for p in paths:
        fig.savefig(p, dpi=130)
    plt.close(fig)
    return paths
