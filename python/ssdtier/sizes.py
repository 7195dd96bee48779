"""Byte sizes: parsing ("64MiB", "1.5GiB", "10GB") and formatting for humans."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from .errors import bad_value

__all__ = ["GiB", "KiB", "MiB", "TiB", "exact_size", "format_size", "parse_size"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
}
_BINARY_UNITS = (
    ("KiB", KiB),
    ("MiB", MiB),
    ("GiB", GiB),
    ("TiB", TiB),
    ("PiB", 1 << 50),
)
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*", re.ASCII)
SIZE_HELP = (
    "a non-negative size: an integer number of bytes or a string such as "
    "'4096', '64MiB', '1.5GiB' or '10GB' (units B, KB, MB, GB, TB, PB, "
    "KiB, MiB, GiB, TiB, PiB)"
)


def parse_value(value: Any, key: str, source: str | None) -> int:
    if isinstance(value, bool):
        bad_value(source, key, value, SIZE_HELP, show_type=True)
    if isinstance(value, int):
        if value < 0:
            bad_value(source, key, value, SIZE_HELP)
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or not value.is_integer():
            bad_value(source, key, value, SIZE_HELP)
        return int(value)
    if not isinstance(value, str):
        bad_value(source, key, value, SIZE_HELP, show_type=True)
    m = _SIZE_RE.fullmatch(value)
    mult = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or mult is None:
        bad_value(source, key, value, SIZE_HELP)
    amount = Fraction(m.group(1)) * mult
    if mult == 1 and amount.denominator != 1:
        bad_value(source, key, value, SIZE_HELP, hint=" (not a whole number of bytes)")
    # Fractions of a larger unit are rounded down to whole bytes.
    return int(amount)


def parse_size(value: float | str, *, key: str = "size", source: str = "<value>") -> int:
    """Parse a byte size.

    Args:
        value: A non-negative int (bytes), an integral float, or a string such
            as ``"4096"``, ``"64MiB"``, ``"64 mib"``, ``"1.5GiB"`` or ``"10GB"``.
            Binary units (KiB..PiB) are powers of 1024, SI units (KB..PB)
            powers of 1000; units are case-insensitive. A fraction of a unit is
            rounded down to whole bytes.
        key: Key named in error messages.
        source: Where the value came from, named in error messages.

    Returns:
        The size in bytes.

    Raises:
        ConfigError: ``value`` is not a valid size.
    """
    return parse_value(value, key, source)


def format_size(n: int) -> str:
    """Format a byte count for humans.

    Exact binary units are used when ``n`` is divisible by one (``"1GiB"``),
    otherwise one decimal (``1536 -> "1.5KiB"``); below 1 KiB plain bytes
    (``"100B"``).

    Raises:
        TypeError: ``n`` is not an int.
        ValueError: ``n`` is negative.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"format_size() needs an int, got {n!r}")
    if n < 0:
        raise ValueError(f"format_size() needs a non-negative size, got {n}")
    best = f"{n}B"
    for i, (unit, mult) in enumerate(_BINARY_UNITS):
        if n < mult:
            break
        if n % mult == 0:
            best = f"{n // mult}{unit}"
        elif round(n / mult, 1) < 1024 or unit == _BINARY_UNITS[-1][0]:
            best = f"{n / mult:.1f}{unit}"
        else:  # e.g. 1048575 is "1.0MiB", not "1024.0KiB"
            best = f"{n / (mult * 1024):.1f}{_BINARY_UNITS[i + 1][0]}"
    return best


def exact_size(n: int) -> str:
    """Human size text that parses back to exactly ``n``."""
    text = format_size(n)
    if parse_value(text, "size", None) == n:
        return text
    units = [
        *_BINARY_UNITS,
        ("KB", 10**3),
        ("MB", 10**6),
        ("GB", 10**9),
        ("TB", 10**12),
    ]
    exact = [f"{n // mult}{unit}" for unit, mult in units if n % mult == 0]
    return min(exact, key=len, default=f"{n}B")
