"""How a value reads: for people (:func:`format_value`, units from the key, :func:`unit_for`), and
as numbers by name (:func:`flatten`). The console backend and the HTML report print values with
these; the report and the live view (``forge-obs serve``) chart what :func:`flatten` gives.

    >>> format_value(6.0), format_value(0.25), format_value(1.5, unit_for("trainer/step_s"))
    ('6', '0.25', '1.5 s')
    >>> format_value(3 * 2**30, unit_for("gen/kv_cache_bytes")), format_value(12345.6)
    ('3 GiB', '12.35k')
    >>> format_value({"p50": 6.02, "p90": 7.0, "p99": 8.3, "count": 128})
    'p50=6 p90=7 p99=8.3 n=128'
    >>> out = {}; flatten("lat", {"p50": 1, "count": 3, "note": "x"}, out); out
    {'lat/p50': 1.0, 'lat/count': 3.0}

Numbers: integral values print as integers (``evicted_episodes=0``, not ``0.0``), others with 4
significant digits (``12.35k`` past 10,000); a distribution's quantiles with 3 (the sketch's 1 %
error), snapped to the integer they are within 1 % of (``seq_len_tokens=p50=6 p90=7 n=128``).
Units come from the key's last part: ``_s``/``_ms``/``_us``/``_ns`` durations (scaled to the
unit that reads best), ``_bytes`` (KiB, MiB, GiB), ``_per_s``, ``_pct``. Keys and text print
with their control characters escaped (:func:`~forge_obs.core.safe.printable`). Nothing here
raises for any value.
"""

from __future__ import annotations

import math
from itertools import repeat
from typing import Any

from forge_obs.core.safe import printable, safe_repr, safe_str

__all__ = ["QUANTILES", "unit_for", "format_value", "format_values", "is_distribution", "flatten"]

#: the quantiles a distribution's value carries (with its ``count``)
QUANTILES = ("p50", "p90", "p99")

#: key suffix -> unit (longest first)
_SUFFIX_UNITS = (
    ("_per_sec", "/s"),
    ("_per_s", "/s"),
    ("_seconds", "s"),
    ("_bytes", "bytes"),
    ("_percent", "%"),
    ("_pct", "%"),
    ("_sec", "s"),
    ("_ms", "ms"),
    ("_us", "us"),
    ("_ns", "ns"),
    ("_s", "s"),
)
_TIME_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def unit_for(key: str, units: dict[str, str] | None = None) -> str:
    """Unit of ``key``: from ``units`` (exact key, then longest prefix), else from its suffix."""
    if units:
        if key in units:
            return units[key]
        best = max((p for p in units if p.endswith("/") and key.startswith(p)), key=len, default=None)
        if best is not None:
            return units[best]
    name = key.rsplit("/", 1)[-1]
    for suffix, unit in _SUFFIX_UNITS:
        if name.endswith(suffix) and len(name) > len(suffix):
            return unit
    return ""


_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _num(v: float, digits: int = 4) -> str:
    """``v`` with ``digits`` significant digits; an integral value as an integer."""
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if v == int(v) and a < 1e7:
        return str(int(v))
    if a >= 1e4:
        for scale, suffix in _SI:
            if a >= scale:
                return f"{v / scale:.{digits}g}{suffix}"
    return f"{v:.{digits}g}"


def _quantile(v: float) -> str:
    """A sketch quantile (1 % relative error): 3 significant digits, or the integer within 1 %."""
    if math.isfinite(v) and abs(v) >= 1 and abs(v - round(v)) <= 0.01 * abs(v):
        return str(int(round(v)))
    return _num(v, 3)


def _with_unit(v: float, unit: str, sep: str = " ", digits: int = 4) -> str:
    if not math.isfinite(v):
        return str(v)
    if unit in _TIME_SCALE:
        secs = v * _TIME_SCALE[unit]
        a = abs(secs)
        if a == 0 or a >= 1:
            return f"{_num(secs, digits)}{sep}s"
        for scale, name in ((1e3, "ms"), (1e6, "us"), (1e9, "ns")):
            if a * scale >= 1 or name == "ns":
                return f"{secs * scale:.{digits}g}{sep}{name}"
    if unit == "bytes":
        a = abs(v)
        for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if a >= scale:
                return f"{_num(v / scale, digits)}{sep}{name}"
        return f"{v:.0f}{sep}B"
    return f"{_num(v, digits)}{sep}{unit}"


def format_value(v: Any, unit: str = "", sep: str = " ") -> str:
    """A value for humans: ``6``, ``0.25``, ``1.5 s``, ``3 GiB``, ``p50=1.2 ms p90=… n=100``.
    Never raises: a value that cannot be formatted (a dict that contains itself, a ``__str__``
    that raises) prints as its ``repr``, or ``<TypeName>``."""
    try:
        return _format(v, unit, sep)
    except Exception:  # noqa: BLE001 - one key's value never costs the step's others
        return safe_repr(v)


def format_values(values: list, units: list[str]) -> list[str]:
    """:func:`format_value` of each value with its unit (one unit per value), for a whole block:
    plain floats without a unit, each finite and under 10,000 in size, are written in one pass
    (4 significant digits, an integral value as an integer: what :func:`format_value` writes for
    them); any other block value by value."""
    try:
        if values and not any(units) and set(map(type, values)) == {float}:
            mags = list(map(abs, values))
            total = sum(mags)
            if total - total == 0 and max(mags) < 1e4:  # finite (no inf, no NaN) and small
                out = list(map(format, values, repeat(".4g")))
                if "-0" in out:  # -0.0 reads as 0, as format_value writes it
                    out = ["0" if x == "-0" else x for x in out]
                return out
    except Exception:  # noqa: BLE001 - value by value below
        pass
    return list(map(format_value, values, units))


def _format(v: Any, unit: str, sep: str) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float)):
        return _with_unit(float(v), unit, sep) if unit else _num(float(v))
    if isinstance(v, dict):
        quantiles = is_distribution(v)
        parts = []
        for k, x in v.items():
            if k == "count":
                parts.append(f"n={_format(x, '', ' ')}")
            elif quantiles and isinstance(x, (int, float)) and not isinstance(x, bool) and k.startswith("p"):
                parts.append(f"{k}={_with_unit(float(x), unit, '', 3) if unit else _quantile(float(x))}")
            else:
                parts.append(f"{printable(safe_str(k))}={_format(x, unit if k != 'nan' else '', '')}")
        return " ".join(parts)
    if isinstance(v, list):
        if v and all(isinstance(r, dict) for r in v):
            return f"<{len(v)} rows>"
        return f"<{len(v)} values>"
    item = getattr(v, "item", None)
    if callable(item):
        try:
            return _format(item(), unit, sep)
        except Exception:  # noqa: BLE001
            pass
    return printable(safe_str(v))


def is_distribution(v: Any) -> bool:
    """Whether ``v`` is a distribution's value (a dict with its quantiles)."""
    return isinstance(v, dict) and all(q in v for q in QUANTILES)


def flatten(key: str, v: Any, out: dict[str, float]) -> None:
    """``v`` (a number, bool or nested dict of them) into ``out`` as ``key/...`` -> float;
    anything else is left out."""
    if isinstance(v, bool):
        out[key] = float(v)
    elif isinstance(v, (int, float)):
        out[key] = float(v)
    elif isinstance(v, dict):
        for k, x in v.items():
            flatten(f"{key}/{k}", x, out)
