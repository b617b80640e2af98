"""Short human-readable text for numbers the views show."""

from __future__ import annotations


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def size(count: float | None) -> str:
    if count is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit in ("B", "KB") else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"


def number(value: float | str) -> str:
    if isinstance(value, str):
        return value
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3e}"
    return f"{value:.4f}"


def progress_line(step: int, total: int | None, elapsed: float) -> str:
    """'step 50/100 · 12.3 it/s · ETA 4 s' from a progress update."""
    rate = step / elapsed if elapsed > 0 else 0.0
    text = f"step {step}/{total}" if total else f"step {step}"
    text += f" · {rate:.1f} it/s"
    if total and rate > 0:
        text += f" · ETA {duration((total - step) / rate)}"
    return text
