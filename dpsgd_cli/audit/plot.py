"""Claimed ε against the audit's ε_lo, a panel per threat model, the diagonal ε_lo = ε; refuted claims stand out,
an uninformative verdict is hollow, and each cell's broken twin shows the bound a real bug would give."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from dpsgd_cli.engine.folder import save_figure  # noqa: E402
from dpsgd_cli.plots import names  # noqa: E402
from dpsgd_cli.plots.layout import MARKERS, finish  # noqa: E402


def audit_figure(frame: pd.DataFrame):
    """The laid-out figure (None when no audit row is ok with both a bound and a claim)."""
    ok = frame[(frame["status"] == "ok") & frame["epsilon_lo"].notna() & frame["epsilon_claimed"].notna()]
    if ok.empty:
        return None
    threats = sorted(ok["threat_model"].unique())
    fig, axes = plt.subplots(1, len(threats), figsize=(max(6.0, 4.4 * len(threats)), 3.8), squeeze=False, dpi=130)
    algorithms = sorted(ok["algorithm"].unique())
    styles = {a: (plt.cm.tab10(i % 10), MARKERS[i % len(MARKERS)]) for i, a in enumerate(algorithms)}
    ceilings = ok["ceiling"] if "ceiling" in ok else pd.Series(dtype=float)
    twins = ok["control_epsilon_lo"] if "control_epsilon_lo" in ok else pd.Series(dtype=float)
    top = float(np.nanmax([ok["epsilon_claimed"].max(), ok["epsilon_lo"].max(), ceilings.max(), twins.max()])) * 1.15
    margin = 0.05 * top
    for ax, threat in zip(axes[0], threats):
        part = ok[ok["threat_model"] == threat]
        ax.plot([0, top], [0, top], color="0.4", lw=1, ls="--",
                label=r"$\varepsilon_{lo} = \varepsilon$ (above: refuted)")
        ax.fill_between([0, top], [0, top], [top, top], color="tab:red", alpha=0.07)
        if "ceiling" in part and part["ceiling"].notna().any():  # no audit of these trials can reach above it
            ceiling = float(part["ceiling"].min())
            ax.axhline(ceiling, color="0.3", lw=1, ls=":", label=f"ceiling of the trials (≥ {ceiling:.2f})")
        present = sorted(part["algorithm"].unique())
        for algo, group in part.groupby("algorithm"):
            color, marker = styles[algo]
            # algorithms side by side at a shared ε (several at ε_lo = 0 would hide one another)
            group = group.assign(epsilon_claimed=group["epsilon_claimed"]
                                 + (present.index(algo) - (len(present) - 1) / 2) * 0.015 * top)
            verdict = group["verdict"] if "verdict" in group else pd.Series(
                np.where(group["epsilon_lo"] > group["epsilon_claimed"], "refuted", ""), index=group.index)
            refuted = verdict == "refuted"  # a not-covered row refutes nothing
            hollow = verdict.isin(["uninformative", "not covered"])
            solid = ~refuted & ~hollow
            ax.scatter(group["epsilon_claimed"][solid], group["epsilon_lo"][solid], color=color, marker=marker,
                       label=names.algorithm(algo), s=30, zorder=4)
            ax.scatter(group["epsilon_claimed"][hollow], group["epsilon_lo"][hollow], facecolors="none",
                       edgecolors=color, marker=marker, s=30, zorder=4, linewidths=1.2,
                       label=None if solid.any() else names.algorithm(algo))
            ax.scatter(group["epsilon_claimed"][refuted], group["epsilon_lo"][refuted], color=color,
                       marker="X", s=110, edgecolor="red", linewidth=1.5, zorder=5,
                       label=f"{names.algorithm(algo)}: REFUTED" if refuted.any() else None)
            if "control_epsilon_lo" in group and group["control_epsilon_lo"].notna().any():
                twin = group[group["control_epsilon_lo"].notna()]
                ax.vlines(twin["epsilon_claimed"], twin["epsilon_lo"], twin["control_epsilon_lo"].clip(upper=top),
                          color=color, lw=0.8, alpha=0.5, zorder=3)
                ax.scatter(twin["epsilon_claimed"], twin["control_epsilon_lo"].clip(upper=top), color=color,
                           marker="_", s=90, linewidths=1.6, zorder=4)
        if "control_epsilon_lo" in part and part["control_epsilon_lo"].notna().any():
            ax.scatter([], [], color="0.3", marker="_", s=90, linewidths=1.6,
                       label=r"its broken twin's $\varepsilon_{lo}$ (noise × control: the bound a real bug gives)")
        if "verdict" in part and part["verdict"].isin(["uninformative", "not covered"]).any():
            ax.scatter([], [], facecolors="none", edgecolors="0.3", marker="o", s=30,
                       label="hollow: uninformative or not covered (see audit.csv's reason)")
        ax.set(xlim=(-margin, top), ylim=(-margin, top), xlabel=r"claimed $\varepsilon$ (accountant)",
               ylabel=r"audited lower bound $\varepsilon_{lo}$")
        ax.set_title(names.literal(threat), fontsize=10)
    finish(fig, title="Privacy audit: claimed ε against the empirical lower bound", legend_size=8)
    return fig


def plot_audit(frame: pd.DataFrame, folder: Path) -> list[Path]:
    fig = audit_figure(frame)
    if fig is None:
        return []
    paths = [save_figure(fig, folder / name, dpi=130) for name in ("audit.png", "audit.pdf")]
    plt.close(fig)
    return paths
