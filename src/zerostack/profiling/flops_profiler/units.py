"""Numbers as DeepSpeed's flops profiler writes them: ``"1.23 G"``, ``"1.23 GMACs"``, ``"1.5 B"``.

Two decimals with trailing zeros dropped (``:g``), an SI prefix picked from the size unless
``units`` names one, and a space between number and prefix even when the prefix is empty
(``number_to_string(0) == "0 "``). Parameter counts say B (billion) where the others say G::

    number_to_string(1_234_567)     # '1.23 M'
    macs_to_string(7.86e6)          # '7.86 MMACs'
    flops_to_string(2.5e12)         # '2.5 TFLOPS'
    params_to_string(1.5e9)         # '1.5 B'
    duration_to_string(0.00123)     # '1.23 ms'
"""

from __future__ import annotations

PRECISION = 2
"""Decimals kept (DeepSpeed's DEFAULT_PRECISION)."""

# Largest first; a number takes the first prefix it reaches, "u" below a thousandth.
_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6))
_SCALE = dict(_PREFIXES)


def _prefix(num: float) -> str:
    if num == 0:
        return ""
    return next((p for p, scale in _PREFIXES if num >= scale), "u")


def number_to_string(num: float, units: str | None = None, precision: int = PRECISION) -> str:
    """``num`` with an SI prefix: ``number_to_string(15_728_640) == "15.73 M"``."""
    if units is None:
        units = _prefix(num)
    return f"{round(num / _SCALE.get(units, 1.0), precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = PRECISION) -> str:
    """Multiply-accumulates: ``"7.86 MMACs"``."""
    return number_to_string(macs, units, precision) + "MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = PRECISION) -> str:
    """A rate, floating-point operations per second: ``"1.23 GFLOPS"``."""
    return number_to_string(flops, units, precision) + "FLOPS"


def bytes_to_string(b: float, units: str | None = None, precision: int = PRECISION) -> str:
    """Bytes: ``"1.5 GB"``."""
    return number_to_string(b, units, precision) + "B"


def params_to_string(params: float, units: str | None = None, precision: int = PRECISION) -> str:
    """A parameter count, billions as B and no trailing space: ``"1.5 B"``, ``"120 K"``."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = PRECISION) -> str:
    """Seconds: ``"1.23 ms"``."""
    return number_to_string(seconds, units, precision) + "s"
