"""Byte sizes: the binary units every report uses, and how a size prints."""

from __future__ import annotations

KIB, MIB, GIB = 2**10, 2**20, 2**30


def format_bytes(size: float, digits: int = 3) -> str:
    """``size`` bytes in the largest binary unit it fills, to ``digits`` significant digits: 67108864 → '64 MiB'."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return f"{size / scale:.{digits}g} {unit}"
    return f"{size:g} B"
