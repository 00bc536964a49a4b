"""Human-readable sizes and work for EXPLAIN, progress lines and benchmarks.

A foundation module: any layer may import it.

>>> format_bytes(1536), format_bytes(3 * 2**20), format_bytes(12)
('1.5 KiB', '3.0 MiB', '12 B')
>>> format_flops(2.5e9), format_flops(999)
('2.50 GFLOP', '999 FLOP')
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_flops"]


def format_bytes(n: float) -> str:
    """Bytes in binary units (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_flops(n: float) -> str:
    """Floating-point operations in decimal units (KFLOP ... TFLOP)."""
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"
