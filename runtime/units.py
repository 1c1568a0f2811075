"""Byte sizes written by people: parse `6GiB`, `512MiB`, `80GB`; print a count of bytes back as people read it.

Contract: `parse_bytes` accepts exactly one spelling per unit, case-sensitive, so a typo is an error rather than a
guess: `6GIB`, `6gb`, `6 gib?` and `6G` are refused. Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal
units (KB, MB, GB, TB) powers of 1000, `B` is bytes. A number may have a fraction (`1.5GiB`) only when the result
is a whole number of bytes. A bare integer (YAML `1073741824`) is a count of bytes; a string always needs its unit.
One space between number and unit is allowed (`6 GiB`). Errors are `ValueError` saying what was wrong and what
is allowed; the caller adds the key path.
"""
from __future__ import annotations

import re
from fractions import Fraction

UNITS: dict[str, int] = {
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}
ALLOWED_UNITS_TEXT = "an integer count of bytes, or a number with one of the units " + ", ".join(UNITS)

_SIZE_RE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?) ?(?P<unit>[A-Za-z]+)")


def parse_bytes(value: object) -> int:
    """A non-negative byte count from an int or a string like `6GiB`; `ValueError` names what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"expected {ALLOWED_UNITS_TEXT}, got the boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a non-negative number of bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected {ALLOWED_UNITS_TEXT}, got {type(value).__name__} {value!r}")
    match = _SIZE_RE.fullmatch(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a size; expected {ALLOWED_UNITS_TEXT} (for example 6GiB or 512MiB)")
    unit = match["unit"]
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r} in {value!r}; units are case-sensitive: {', '.join(UNITS)}")
    exact = Fraction(match["number"]) * UNITS[unit]
    if exact.denominator != 1:
        raise ValueError(f"{value!r} is not a whole number of bytes ({float(exact)}); use a smaller unit")
    return int(exact)


def format_bytes(num_bytes: int) -> str:
    """`num_bytes` in the largest binary unit that keeps the number >= 1, with up to 2 decimals: `1.5 GiB`."""
    sign = "-" if num_bytes < 0 else ""
    size = abs(num_bytes)
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size >= UNITS[unit]:
            text = f"{size / UNITS[unit]:.2f}".rstrip("0").rstrip(".")
            return f"{sign}{text} {unit}"
    return f"{sign}{size} B"


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value` (both non-negative, multiple > 0)."""
    return -(-value // multiple) * multiple
