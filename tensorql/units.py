"""Human-readable sizes and work for EXPLAIN, progress lines and benchmarks.

A foundation module: any layer may import it.

>>> format_bytes(1536), format_bytes(3 * 2**20), format_bytes(12)
('1.5 KiB', '3.0 MiB', '12 B')
>>> format_flops(2.5e9), format_flops(999), format_flops(3 * 10 ** 400)
('2.50 GFLOP', '999 FLOP', '3.00e+400 FLOP')
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_flops", "scientific"]

_HUGE = 10**21  # beyond this, figures print in scientific notation


def format_bytes(n: float) -> str:
    """Bytes in binary units (B, KiB, MiB, GiB, TiB); beyond a float, TiB in scientific
    notation from the exact integer."""
    if isinstance(n, int) and abs(n) >= _HUGE:
        return f"{scientific(n // 2**40)} TiB"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_flops(n: float) -> str:
    """Floating-point operations in decimal units (KFLOP ... TFLOP); counts past 10**21 (a
    billion TFLOP, exact Python ints up to any size) in scientific notation."""
    if n >= _HUGE:
        return f"{scientific(n)} FLOP"
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def scientific(n: float) -> str:
    """``n`` as ``d.dde+N``, read off the digits of an int, so numbers past a float's range
    (naive FLOP counts of large networks) print too.

    >>> scientific(2 * 1000 ** 104), scientific(12345), scientific(2.5e30), scientific(7)
    ('2.00e+312', '1.23e+04', '2.50e+30', '7.00e+00')
    >>> scientific(3 * 10 ** 9000)  # past the digits Python turns into a str
    '3.00e+9000'
    """
    if not isinstance(n, int):
        return f"{n:.2e}"
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n == 0:
        return "0.00e+00"
    exponent = int((n.bit_length() - 1) * 0.30102999566398120)  # log10(2): near, then exact
    while 10 ** (exponent + 1) <= n:  # (powers of ten, no int -> str: that has a limit)
        exponent += 1
    while 10 ** exponent > n:
        exponent -= 1
    scaled = n * 1000 // 10 ** exponent if exponent < 3 else n // 10 ** (exponent - 3)
    lead = (scaled + 5) // 10  # three significant digits, rounded half up
    if lead == 1000:  # 9995... rounds up to the next power of ten
        lead, exponent = 100, exponent + 1
    return f"{sign}{lead // 100}.{lead % 100:02d}e{exponent:+03d}"


def positive_int(text: str) -> int:
    """A command-line count: an integer >= 1 (argparse's ``type=``; its error names it).

    >>> positive_int("3")
    3
    >>> positive_int("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be an integer >= 1, got '0'
    """
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value
