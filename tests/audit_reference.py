"""Regenerate tests/data/audit_reference.json: JAX Privacy's auditor (jax_privacy.auditing, the field's reference
implementation) on fixed scores, for `tests/test_audit.py` to check dpsgd's own statistics against without JAX.

    pip install jax-privacy && python tests/audit_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "data" / "audit_reference.json"


def fixed_scores() -> dict[str, np.ndarray]:
    """Scores rounded to 2 decimals (ties included); the one-run set has m = 1000 canaries, half in."""
    rng = np.random.default_rng(20261122)
    inc = rng.random(1000) < 0.5
    one_run = np.round(rng.standard_normal(1000) + 2.0 * inc, 2)
    return {"in": np.round(rng.standard_normal(300) + 1.5, 2), "out": np.round(rng.standard_normal(300), 2),
            "one_run_in": one_run[inc], "one_run_out": one_run[~inc]}


def main() -> None:
    import jax_privacy
    from jax_privacy import auditing

    s = fixed_scores()
    auditor = auditing.CanaryScoreAuditor(s["in"], s["out"])
    cp = [{"threshold": t, "delta": d, "significance": a,
           "epsilon": float(auditor.epsilon_clopper_pearson(a, d, threshold_strategy=auditing.Explicit(t)))}
          for t in (0.0, 1.0, 2.0, 2.5, 3.0) for d in (0.0, 1e-3) for a in (0.05, 0.01)]
    one = auditing.CanaryScoreAuditor(s["one_run_in"], s["one_run_out"])
    ranked = np.sort(np.concatenate([s["one_run_in"], s["one_run_out"]]))[::-1]
    runs = [{"threshold": float(t), "delta": d,
             "epsilon": float(one.epsilon_one_run(0.05, d, threshold_strategy=auditing.Explicit(float(t))))}
            for t in (ranked[49], ranked[199], ranked[399]) for d in (1e-6, 1e-4)]
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"jax_privacy": jax_privacy.__version__, "clopper_pearson": cp, "one_run": runs,
                               "bonferroni_epsilon": float(auditor.epsilon_clopper_pearson(0.05, 1e-3))}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
