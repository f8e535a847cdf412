#!/usr/bin/env python3
"""Summarises scripts/islands_wallclock.sh: for every run, its final eval loss, wall-clock, and
the wall-clock at which it first reached the synchronous job's final eval loss (the target);
draws eval loss against wall-clock seconds as SVG. Standard library only.
Usage: islands_wallclock.py [DIR] [OUT_SVG]"""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from plot_curves import chart  # noqa: E402


def curve(r):
    elapsed = {s["step"]: s["elapsed_s"] for s in r["steps"]}
    return [(e["step"], elapsed.get(e["step"], 0.0), e["loss"]) for e in r["evals"]]


def tokens_per_s(r):
    """Tokens of every step over the run's wall-clock: every island runs the job's micro-batches
    on average (reports written before islands were counted gave one island's throughput)."""
    c = r["config"]
    islands = (r.get("outer") or {}).get("islands", 1)
    return len(r["steps"]) * c["batch_size"] * c["seq_len"] * c["micro_batches"] * islands / r["wall_s"]


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "docs/results/islands-wallclock"
    svg = sys.argv[2] if len(sys.argv) > 2 else "docs/plots/islands-wallclock-seconds.svg"
    runs = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{d}/*.json"))}
    target = curve(runs["sync"])[-1][2]
    print(f"target: the synchronous job's final eval loss, {target:.4f}")
    print("| run | final eval loss | wall-clock s | tokens/s | reached target at step | at s | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = None
    rows = []
    for name, r in runs.items():
        c = curve(r)
        hit = next(((s, t) for s, t, l in c if l <= target), None)
        if name == "sync":
            base = hit[1] if hit else None
        rows.append((name, r, c, hit))
    for name, r, c, hit in rows:
        speed = f"{base / hit[1]:.2f}x" if hit and base else "-"
        print(f"| {name} | {c[-1][2]:.4f} | {r['wall_s']:.0f} | {tokens_per_s(r):.0f} | "
              + (f"{hit[0]} | {hit[1]:.0f} | {speed} |" if hit else "not reached | - | - |"))
    series = [{"setup": n, "curve": [(s, t, l) for s, t, l in c]} for n, _, c, _ in rows]
    open(svg, "w").write(chart(series, 1, "wall-clock seconds",
                               "gpt2-tiny on slow-link.toml: synchronous vs 2 islands"))


if __name__ == "__main__":
    main()
