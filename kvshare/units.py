"""Human-readable byte sizes: parse "16GiB" / "512MiB" / "4096" and format them back."""

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in `text` ("16GiB", "1.5GB", "4096"). Raises ValueError that names the accepted units."""
    if isinstance(text, int):
        return text
    match = _PATTERN.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read size {text!r}: write a number with an optional unit such as 512MiB, 16GiB or 2GB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """`n` bytes in binary units, e.g. 17179869184 -> '16.0 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
