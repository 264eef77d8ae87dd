"""Case 7: the privacy audit — 2 × 1000 replicas of dp_sgd on adult (logistic regression, B = 256, 1 epoch,
ε = 1), trained as replicas of one chain, each scored (`dpsgd audit`'s input canary: two vectorised fits, the
world with the canary and the world without), and ε_lo. The goal: under 2 minutes on a 2-core machine.
The gradient canary (one fit of 2000 replicas, white box) is timed beside it. `--quick`: 2 × 200 replicas.
"""

from __future__ import annotations

from benchmarks.common import Row, Skip, best_of, fmt_time, load

GOAL_S = 120.0


def run(ctx) -> list[Row]:
    from threadpoolctl import threadpool_limits

    from dpsgd_cli.audit.engine import audit_cell
    from dpsgd_cli.config import AuditSpec, GridFile, expand

    trials = 200 if ctx.quick else 1000
    what = f"audit: 2 × {trials} replicas of dp_sgd, adult, logreg, B = 256, 1 epoch, with scores and ε_lo"
    try:
        load({"name": "adult"})
    except Skip as skip:
        return [Row("7", what, goal="< 2 min", note=f"skipped: {skip}")]
    grid = GridFile.model_validate({"grids": [{
        "name": "bench_audit", "datasets": ["adult"], "models": ["logreg"], "algorithms": ["dp_sgd"], "epsilon": [1],
        "batch_size": [256], "lr": [2.0], "epochs": 1, "l2": 1e-4, "clip_norm": 1.0, "seeds": 1}]}).grids[0]
    cell = expand(grid)[0]
    rows = []
    for kind in ("input", "gradient"):
        spec = AuditSpec(canaries=[kind], trials=trials)
        with threadpool_limits(1):  # as `dpsgd` runs: one BLAS thread
            timing, result = best_of(lambda: audit_cell(cell, spec), 1 if ctx.quick else ctx.k)
        first = result[0]
        rate = 2 * trials * (first["steps"] or 0) / timing.min
        goal = kind == "input" and not ctx.quick
        rows.append(Row(
            "7" + ("a" if kind == "input" else "b"), what + f" ({kind} canary)",
            ours=f"{fmt_time(timing.min)} ({rate / 1e3:.1f} k replica-steps/s)",
            goal="< 2 min" if goal else "–", met=(timing.min < GOAL_S) if goal else None,
            note=f"ε = {first['epsilon_claimed']:.3f}: ε_lo = {first['epsilon_lo']:.3f} ({first['threat_model']}), "
                 f"AUC {first['auc']:.3f}; {first['steps']} steps, best of {timing.k}",
            data={**timing.json(), "epsilon_lo": first["epsilon_lo"], "auc": first["auc"], "trials": trials}))
    return rows
