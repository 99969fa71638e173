"""A self-contained SVG line chart (no plotting library): the figures the studies and the speed
benchmarks write beside their tables (DReSS's slice mass per layer, SparseLinear's speedup per
token count). :func:`pyprune.studies.compare.plot` draws the report comparisons with matplotlib."""
from __future__ import annotations

import math


def line_plot(series, title, x_label, y_label, log2_x=True, reference_y=1.0,
              width=720, height=420):
    """A self-contained SVG line chart. ``series`` maps a label to [(x, y), ...]; a dashed line
    marks ``reference_y`` (speedup 1 = parity with the baseline)."""
    points = [p for values in series.values() for p in values]
    if not points:
        raise ValueError("line_plot needs at least one point")
    fx = (lambda v: math.log2(v)) if log2_x else (lambda v: v)
    xs = [fx(x) for x, _ in points]
    ys = [y for _, y in points] + ([reference_y] if reference_y is not None else [])
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = 0.0, max(ys) * 1.1
    left, right, top, bottom = 60, 200, 40, 50
    px = lambda x: left + (fx(x) - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    py = lambda y: height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)  # noqa: E731
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22", "#17becf"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
           f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">{x_label}</text>',
           f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" '
           f'text-anchor="middle">{y_label}</text>']
    for x in sorted({x for x, _ in points}):
        out.append(f'<text x="{px(x):.1f}" y="{height - bottom + 16}" text-anchor="middle">{x:g}</text>')
    for i in range(6):
        y = y0 + (y1 - y0) * i / 5
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
    if reference_y is not None:
        out.append(f'<line x1="{left}" y1="{py(reference_y):.1f}" x2="{width - right}" '
                   f'y2="{py(reference_y):.1f}" stroke="gray" stroke-dasharray="4 3"/>')
    for i, (label, values) in enumerate(series.items()):
        color = colors[i % len(colors)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(values))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{width - right + 10}" y="{top + 16 * i + 10}" fill="{color}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
