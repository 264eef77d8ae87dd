"""Input checks shared by the privacy modules: each raises a one-line UserError naming parameter, value and range."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable

from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule

# `import dpsgd_cli` imports this module: NumPy waits until a PLD's size is estimated
np = LazyModule("numpy")
rdp = LazyModule("dpsgd_cli.privacy.rdp")


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(f"{name} must be a real number, got {value!r}")
    return float(value)


def _within(name: str, value: object, holds: Callable[[float], bool], interval: str) -> float:
    """``value`` as a float if `holds` for it, else a UserError naming `interval`."""
    x = _as_float(name, value)
    if not holds(x):
        raise UserError(f"{name} must be in {interval}, got {value!r}")
    return x


def positive(name: str, value: object) -> float:
    return _within(name, value, lambda x: math.isfinite(x) and x > 0, "(0, inf)")


def non_negative(name: str, value: object) -> float:
    return _within(name, value, lambda x: math.isfinite(x) and x >= 0, "[0, inf)")


def open_unit(name: str, value: object) -> float:
    return _within(name, value, lambda x: 0 < x < 1, "(0, 1)")


def half_open_unit_left_closed(name: str, value: object) -> float:
    return _within(name, value, lambda x: 0 <= x < 1, "[0, 1)")


def sample_rate(name: str, value: object) -> float:
    return _within(name, value, lambda x: 0 < x <= 1, "(0, 1]")


SIGMA_RANGE = (1e-3, 1e6)  # noise multipliers the accountants evaluate without overflow (calibration: [1e-2, 1e6])


def noise_multiplier(name: str, value: object) -> float:
    """A noise multiplier in SIGMA_RANGE: outside it the RDP and PLD computations overflow or divide by zero."""
    return _within(name, value, lambda x: SIGMA_RANGE[0] <= x <= SIGMA_RANGE[1],
                   f"[{SIGMA_RANGE[0]:g}, {SIGMA_RANGE[1]:g}]")


def count(name: str, value: object, maximum: int | None = None) -> int:
    """An integer >= 1 (an integral float such as ``590.0`` is accepted), at most `maximum` if given."""
    if isinstance(value, bool):
        raise UserError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(value, numbers.Integral):
        n = int(value)
    elif isinstance(value, numbers.Real) and math.isfinite(float(value)) and float(value).is_integer():
        n = int(value)  # type: ignore[call-overload]  # numbers.Real declares no __int__; an integral float has one
    else:
        raise UserError(f"{name} must be an integer >= 1, got {value!r}")
    if n < 1:
        raise UserError(f"{name} must be an integer >= 1, got {value!r}")
    if maximum is not None and n > maximum:
        raise UserError(f"{name} must be at most {maximum:g}, got {value!r}")
    return n


MEMORY_SHARE = 0.8  # of the memory available now, what one computation may plan to use


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable on Linux; else physical memory)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


_PLD_TAIL = math.log(2 / 1e-15)  # log(2/τ), τ = dp-accounting's default tail mass truncation
_PLD_BYTES_PER_POINT = 200  # measured peak / support points (two PMFs, the FFT's complex temporaries): 76-199


def pld_points(sigma: float, q: float, steps: int, h: float) -> float:
    """Points of the composed privacy-loss PMF dp-accounting builds for T = `steps` Poisson(q)-subsampled
    Gaussians at discretisation interval h, estimated from the loss range without building it (within ~2x of
    measured lengths): one step's loss spans about 2z/σ + 1/σ² (z = the tail's 8.3 standard deviations); the
    library truncates the T-fold composition by Chernoff bounds at orders |λ| ≤ 20/(one step's span), whose
    upper end is T·D_{1+λ} + log(2/τ)/λ (D: the step's Rényi divergence) and lower end ≥ -log(2/τ)/min(1, λ)."""
    span = 2 * math.sqrt(_PLD_TAIL) * 1.0 / sigma + 1.0 / sigma**2
    top = 20.0 / span
    lams = top * np.geomspace(1e-3, 1.0, 40)
    with np.errstate(all="ignore"):
        upper = steps * rdp.subsampled_gaussian_rdp(q, sigma, list(1.0 + lams)) + _PLD_TAIL / lams
    width = min(steps * span, float(np.nanmin(upper)) + _PLD_TAIL / min(1.0, top) + span)
    return width / h


def pld_memory(event: object, h: float) -> None:
    """UserError (one line, with the limit and the way past it) when dp-accounting's PLD of `event` at
    discretisation interval h would not fit in memory: checked before the library allocates it (it would end
    in a MemoryError traceback after minutes, or be killed). `event` is a DP-SGD event (see accounting)."""
    count, inner = 1, event
    while hasattr(inner, "count"):  # SelfComposed (read by attribute: this module does not load dp-accounting)
        count, inner = count * int(getattr(inner, "count")), getattr(inner, "event")
    q = float(getattr(inner, "sampling_probability", 1.0))
    gaussian = getattr(inner, "event", inner)
    if not hasattr(gaussian, "noise_multiplier"):
        return
    sigma = float(gaussian.noise_multiplier)
    need = _PLD_BYTES_PER_POINT * pld_points(sigma, q, count, h)
    have = MEMORY_SHARE * available_memory()
    if need > have:
        raise UserError(f"the PLD accountant at σ = {sigma:g}, q = {q:g}, T = {count:,} (discretisation {h:g}) "
                        f"needs about {need / 2**30:,.1f} GiB of memory, more than the {have / 2**30:,.1f} GiB "
                        f"available ({MEMORY_SHARE:.0%} of what is free now); use accountant rdp, or a larger σ "
                        f"or fewer steps")
