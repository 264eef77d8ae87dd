"""Parameters of the analytic tables (`privacy_curve`, `noise_scale` figures; `dpsgd privacy-curve`): pydantic
models whose bounds are both what the grid validation and the CLI accept and what the CLI's help shows.

Kept free of heavy imports: the CLI reads them to build its help.
"""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, Field, model_validator

EPSILON_RANGE = (1e-3, 1e3)  # target ε of a grid: outside it no noise scale is both representable and meaningful

NOISE_SCALE_MAX_STEPS = 10**6  # = privacy.accounting.PLD_MAX_COMPOSITIONS (not imported: it loads dp-accounting)


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrivacyCurveParams(_Params):
    """Parameters of the privacy curve (`kind: privacy_curve` figures and `dpsgd privacy-curve`); the defaults
    are the parameters of Chourasia et al.'s talk. The bounds are what both accept."""

    alpha: float = Field(30.0, gt=1, le=1e6, description="Rényi order α")
    sigma: float = Field(0.02, gt=0, le=1e6, description="noise σ of the update's √(2ησ²) N(0, I)")
    sensitivity: float = Field(4.0, ge=0, le=1e6, description="gradient sensitivity S_g")
    eta: float = Field(0.02, gt=0, le=1e3, description="step size η")
    lam: float = Field(1.0, gt=0, le=1e6, description="strong convexity λ")
    n: int = Field(5000, ge=1, le=10**12, description="number of records n")
    k_max: int = Field(1000, ge=1, le=10**9, description="largest number of steps K")
    points: int = Field(200, ge=2, le=100_000, description="number of K values")
    log_x: bool = Field(False, description="K values spread on a log scale")


class NoiseScaleParams(_Params):
    """Parameters of a `noise_scale` figure: σ of bassily2014 over T = epochs·n (n fixed, δ = 1/n²) and over n
    at fixed T = `steps_fixed` and δ = `delta_fixed` (the lecture's "more data → less noise" holds at fixed T, δ)."""

    epsilon: float = Field(1.0, ge=EPSILON_RANGE[0], le=EPSILON_RANGE[1])
    n: int = Field(30162, ge=2, le=10**7, description="records of the T panel")
    epochs: list[Annotated[float, Field(gt=0, le=100)]] = Field([0.1, 0.3, 1, 3], min_length=1)
    n_values: list[Annotated[int, Field(ge=2, le=10**7)]] = Field([1000, 3000, 10000, 30000], min_length=1)
    steps_fixed: int | None = Field(None, ge=1, description="T of the n panel (default: n)")
    delta_fixed: float | None = Field(None, gt=0, lt=1, description="δ of the n panel (default: 1/n²)")
    skip: list[str] = Field(default_factory=list, description="accountings left out, by label")

    @model_validator(mode="after")
    def _bounded(self) -> NoiseScaleParams:
        steps = max(max(self.epochs) * self.n, self.steps_fixed or self.n)
        if steps > NOISE_SCALE_MAX_STEPS:
            raise ValueError(f"T = epochs·n reaches {steps:.3g} steps, beyond the {NOISE_SCALE_MAX_STEPS:.0e} the PLD "
                             f"accountant handles; lower epochs, steps_fixed or n")
        return self


def bounds(model: type[BaseModel], field: str) -> str:
    """The accepted range of a field as text, e.g. `> 1 and ≤ 1e+06` (for help messages)."""
    symbols = {Gt: ("gt", ">"), Ge: ("ge", "≥"), Lt: ("lt", "<"), Le: ("le", "≤")}
    parts = [f"{sign} {getattr(m, attr):g}" for m in model.model_fields[field].metadata
             for kind, (attr, sign) in symbols.items() if isinstance(m, kind)]
    return " and ".join(parts)
