"""A line chart as SVG text, for an ipywidgets HTML widget.

Plain SVG renders wherever ipywidgets do (JupyterLab, Notebook 7, VS Code,
Colab) without a plotting library or front-end code of our own.
"""

from __future__ import annotations

from html import escape

from notebook_accel.views.format import number


def line_chart(
    points: list[tuple[float, float]], title: str, width: int = 420, height: int = 180
) -> str:
    """An SVG chart of (x, y) points, with the y range and last value labelled."""
    left, right, top, bottom = 56, 12, 22, 24
    inner_w, inner_h = width - left - right, height - top - bottom
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'class="notebook-accel-chart" role="img" aria-label="{escape(title)}">',
        f'<rect x="{left}" y="{top}" width="{inner_w}" height="{inner_h}" fill="none" '
        'stroke="#ccc"/>',
        f'<text x="{left}" y="14" font-size="12" font-family="sans-serif">{escape(title)}</text>',
    ]
    if points:
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        x_low, x_high = min(xs), max(xs)
        y_low, y_high = min(ys), max(ys)
        x_span = (x_high - x_low) or 1.0
        y_span = (y_high - y_low) or 1.0

        def place(x: float, y: float) -> str:
            px = left + (x - x_low) / x_span * inner_w
            py = top + inner_h - (y - y_low) / y_span * inner_h
            return f"{px:.1f},{py:.1f}"

        path = " ".join(place(x, y) for x, y in points)
        parts += [
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{path}"/>',
            _label(left - 4, top + 10, number(y_high), "end"),
            _label(left - 4, top + inner_h, number(y_low), "end"),
            _label(left, height - 6, f"{x_low:g}", "start"),
            _label(width - right, height - 6, f"{x_high:g}", "end"),
            _label(width - right, 14, f"last {number(ys[-1])}", "end"),
        ]
    parts.append("</svg>")
    return "".join(parts)


def _label(x: float, y: float, text: str, anchor: str) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="10" font-family="sans-serif" '
        f'text-anchor="{anchor}">{escape(text)}</text>'
    )
