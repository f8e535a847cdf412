#!/usr/bin/env python3
"""Draws the evaluation-loss curves of a `fusionllm bench --adatopk convergence --json F` report
as two SVG line charts (against step and against wall-clock seconds), with the standard library
only. Usage: plot_curves.py REPORT.json OUT_PREFIX TITLE"""
import json
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
W, H, L, R, T, B = 640, 400, 70, 20, 40, 50


def chart(runs, xkey, xlabel, title):
    series = [(r["setup"], [(p[xkey], p[2]) for p in r["curve"]]) for r in runs]
    xs = [x for _, s in series for x, _ in s]
    ys = [y for _, s in series for _, y in s]
    x0, x1 = 0.0, max(xs) or 1.0
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.05 or 0.1
    y0, y1 = y0 - pad, y1 + pad
    sx = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)
    sy = lambda y: T + (y1 - y) / (y1 - y0) * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W/2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{L}" y1="{H-B}" x2="{W-R}" y2="{H-B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H-B}" stroke="black"/>',
           f'<text x="{(L+W-R)/2}" y="{H-12}" text-anchor="middle">{xlabel}</text>',
           f'<text x="16" y="{(T+H-B)/2}" text-anchor="middle" transform="rotate(-90 16 {(T+H-B)/2})">eval loss</text>']
    for i in range(6):
        xv = x0 + (x1 - x0) * i / 5
        yv = y0 + (y1 - y0) * i / 5
        out.append(f'<text x="{sx(xv)}" y="{H-B+16}" text-anchor="middle">{xv:.0f}</text>')
        out.append(f'<text x="{L-6}" y="{sy(yv)+4}" text-anchor="end">{yv:.2f}</text>')
        out.append(f'<line x1="{L}" y1="{sy(yv)}" x2="{W-R}" y2="{sy(yv)}" stroke="#eee"/>')
    for k, (name, pts) in enumerate(series):
        c = COLORS[k % len(COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{path}"/>')
        out.append(f'<text x="{W-R-150}" y="{T+16+16*k}" fill="{c}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    runs = json.load(open(sys.argv[1]))
    prefix, title = sys.argv[2], sys.argv[3]
    open(prefix + "-steps.svg", "w").write(chart(runs, 0, "step", title))
    open(prefix + "-seconds.svg", "w").write(chart(runs, 1, "wall-clock seconds", title))


if __name__ == "__main__":
    main()
