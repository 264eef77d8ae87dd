"""Input checks shared by the privacy modules.

Every check raises :class:`~dpsgd_cli.errors.UserError` with a one-line message that names the
parameter, the offending value and the allowed range, e.g.
``delta must be in (0, 1), got 1.5``.
"""

from __future__ import annotations

import math
import numbers

from dpsgd_cli.errors import UserError


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(f"{name} must be a real number, got {value!r}")
    return float(value)


def positive(name: str, value: object) -> float:
    """``value`` in (0, inf)."""
    x = _as_float(name, value)
    if not (math.isfinite(x) and x > 0):
        raise UserError(f"{name} must be in (0, inf), got {value!r}")
    return x


def non_negative(name: str, value: object) -> float:
    """``value`` in [0, inf)."""
    x = _as_float(name, value)
    if not (math.isfinite(x) and x >= 0):
        raise UserError(f"{name} must be in [0, inf), got {value!r}")
    return x


def open_unit(name: str, value: object) -> float:
    """``value`` in (0, 1)."""
    x = _as_float(name, value)
    if not (0 < x < 1):
        raise UserError(f"{name} must be in (0, 1), got {value!r}")
    return x


def half_open_unit_left_closed(name: str, value: object) -> float:
    """``value`` in [0, 1)."""
    x = _as_float(name, value)
    if not (0 <= x < 1):
        raise UserError(f"{name} must be in [0, 1), got {value!r}")
    return x


def sample_rate(name: str, value: object) -> float:
    """``value`` in (0, 1]."""
    x = _as_float(name, value)
    if not (0 < x <= 1):
        raise UserError(f"{name} must be in (0, 1], got {value!r}")
    return x


SIGMA_RANGE = (1e-3, 1e6)  # noise multipliers the accountants evaluate without overflow (calibration: [1e-2, 1e6])


def noise_multiplier(name: str, value: object) -> float:
    """A noise multiplier in SIGMA_RANGE: outside it the RDP and PLD computations overflow or divide by zero."""
    x = _as_float(name, value)
    if not (SIGMA_RANGE[0] <= x <= SIGMA_RANGE[1]):
        raise UserError(f"{name} must be in [{SIGMA_RANGE[0]:g}, {SIGMA_RANGE[1]:g}], got {value!r}")
    return x


def count(name: str, value: object, maximum: int | None = None) -> int:
    """An integer >= 1 (an integral float such as ``590.0`` is accepted), at most `maximum` if given."""
    if isinstance(value, bool):
        raise UserError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(value, numbers.Integral):
        n = int(value)
    elif isinstance(value, numbers.Real) and math.isfinite(float(value)) and float(value).is_integer():
        n = int(value)
    else:
        raise UserError(f"{name} must be an integer >= 1, got {value!r}")
    if n < 1:
        raise UserError(f"{name} must be an integer >= 1, got {value!r}")
    if maximum is not None and n > maximum:
        raise UserError(f"{name} must be at most {maximum:g}, got {value!r}")
    return n
