#!/usr/bin/env python3
"""Summarises the reports of scripts/islands_sweep.sh: final eval loss of every run against the
synchronous job at equal tokens, the tokens each run's final loss took the synchronous job (the
convergence penalty), a least-squares fit of the planner's penalty model
`factor - 1 = a ln H + b ln I`, and SVG charts of eval loss against tokens.
Standard library only. Usage: islands_summary.py [DIR] [OUT_PREFIX]
(defaults: docs/results/islands, docs/plots/islands)."""
import glob
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from plot_curves import chart  # noqa: E402


def load(d):
    runs = {}
    for path in sorted(glob.glob(os.path.join(d, "*.json"))):
        r = json.load(open(path))
        name = os.path.basename(path)[:-5]
        c = r["config"]
        outer = r.get("outer")
        islands = outer["islands"] if outer else 1
        per_step = c["batch_size"] * c["seq_len"] * c["micro_batches"] * islands
        curve = [(e["step"] * per_step, e["loss"]) for e in r["evals"]]
        runs[name] = {"islands": islands, "outer": outer, "curve": curve,
                      "final": curve[-1][1], "tokens": curve[-1][0]}
    return runs


def tokens_to(curve, loss):
    """Tokens at which an eval curve first reaches `loss` (linear between evaluations)."""
    prev = (0, float("inf"))
    for t, l in curve:
        if l <= loss:
            if prev[1] == float("inf"):
                return t
            return prev[0] + (t - prev[0]) * (prev[1] - loss) / (prev[1] - l)
        prev = (t, l)
    return None


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "docs/results/islands"
    prefix = sys.argv[2] if len(sys.argv) > 2 else "docs/plots/islands"
    runs = load(d)
    rows, fit = [], []
    print("| run | islands | H | outer lr / momentum | codec | final eval loss | sync at equal tokens | gap | sync tokens to this loss | penalty | pseudo-gradient bytes vs dense |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        if r["outer"] is None:
            continue
        sync = runs.get(f"sync-{r['islands']}")
        if sync is None:
            continue
        o = r["outer"]
        cfg = o["config"]
        codec = cfg["codec"]["kind"]
        reach = tokens_to(sync["curve"], r["final"])
        penalty = r["tokens"] / reach if reach else None
        gap = r["final"] / sync["final"] - 1
        ratio = o["sent_bytes"] / o["dense_bytes"]
        print(f"| {name} | {r['islands']} | {cfg['every']} | {cfg['lr']} / {cfg['momentum']} | {codec} "
              f"| {r['final']:.4f} | {sync['final']:.4f} | {100 * gap:+.1f}% "
              f"| {reach / 1e6:.2f} M of {r['tokens'] / 1e6:.2f} M | "
              + (f"{penalty:.2f}" if penalty else "not reached") + f" | {ratio:.3f} |"
              if reach else
              f"| {name} | {r['islands']} | {cfg['every']} | {cfg['lr']} / {cfg['momentum']} | {codec} "
              f"| {r['final']:.4f} | {sync['final']:.4f} | {100 * gap:+.1f}% | below sync's best | <1 | {ratio:.3f} |")
        rows.append((name, r, penalty))
    # The planner's penalty: per (islands, H), the best dense setting (DiLoCo's outer Nesterov or
    # plain averaging), never below 1 (fewer tokens than synchronous training is not assumed).
    best = {}
    for name, r, penalty in rows:
        cfg = r["outer"]["config"]
        if cfg["codec"]["kind"] != "none":
            continue
        key = (r["islands"], cfg["every"])
        factor = max(1.0, penalty if penalty else 1.0)
        best[key] = min(best.get(key, float("inf")), factor)
    fit = [(math.log(h), math.log(i), f - 1) for (i, h), f in sorted(best.items())]
    if len(fit) >= 2:
        # Least squares without intercept: [sum hh, sum hi; sum hi, sum ii] [a b] = [sum hy, sum iy].
        shh = sum(h * h for h, _, _ in fit)
        shi = sum(h * i for h, i, _ in fit)
        sii = sum(i * i for _, i, _ in fit)
        shy = sum(h * y for h, _, y in fit)
        siy = sum(i * y for _, i, y in fit)
        det = shh * sii - shi * shi
        a = max(0.0, (shy * sii - shi * siy) / det)
        b = max(0.0, (shh * siy - shi * shy) / det)
        print(f"\npenalty (best dense setting per islands and H, at least 1) fitted: "
              f"factor = 1 + {a:.4f} ln H + {b:.4f} ln I")
        for h, i, y in fit:
            print(f"  H={math.exp(h):.0f} I={math.exp(i):.0f}: measured {1 + y:.3f}, model {1 + a * h + b * i:.3f}")
    for n in sorted({r["islands"] for _, r, _ in rows}):
        series = [{"setup": f"sync ({n}x batch)",
                   "curve": [(t / 1e6, 0, l) for t, l in runs[f"sync-{n}"]["curve"]]}]
        for name, r, _ in rows:
            if r["islands"] == n and (name.endswith("-dense") or name.endswith("-avg")):
                series.append({"setup": name, "curve": [(t / 1e6, 0, l) for t, l in r["curve"]]})
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        svg = chart(series, 0, "million tokens",
                    f"gpt2-tiny, Shakespeare (bytes): {n} islands vs synchronous")
        open(f"{prefix}-{n}-tokens.svg", "w").write(svg)


if __name__ == "__main__":
    main()
