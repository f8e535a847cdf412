#!/usr/bin/env bash
# Mixed precision on the CPU: peak memory and step time of gpt2-small and gpt2-medium steps in
# f32, bf16 and f16, storing activations and recomputing them; then convergence of the
# Shakespeare and Fashion-MNIST runs in each precision against f32. Prints tables and writes
# JSON (default docs/results/precision-cpu.json).
#
#   bash scripts/precision_bench.sh [OUT.json]      # from the repository root, after
#                                                   # cargo build --release -p fusion-cli
# MEMORY=0 or CONVERGENCE=0 skips a part; DATA=dir overrides ../shared/data; MODELS and
# PRECISIONS (space-separated) narrow the memory sweep and the convergence runs; SEEDS
# (space-separated, default 1234, the CLI's) repeats the convergence runs per seed, to measure
# their spread; WORK=dir keeps every run's log and report there (default: a temporary directory,
# removed at exit).
set -euo pipefail
out=${1:-docs/results/precision-cpu.json}
bin=${BIN:-target/release/fusionllm}
data=${DATA:-../shared/data}
models=${MODELS:-gpt2-small gpt2-medium}
precisions=${PRECISIONS:-f32 bf16 f16}
seeds=${SEEDS:-1234}
if [ -n "${WORK:-}" ]; then
    work=$WORK
    mkdir -p "$work"
else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
[ -x "$bin" ] || { echo "no $bin: cargo build --release -p fusion-cli" >&2; exit 1; }

run() { # name, then fusionllm train arguments
    local name=$1
    shift
    echo "== $name" >&2
    "$bin" train --nodes 1 --report "$work/$name.json" "$@" > "$work/$name.log" 2>&1 ||
        { tail -5 "$work/$name.log" >&2; return 1; }
}

if [ "${MEMORY:-1}" = 1 ]; then
    for model in $models; do
        for p in $precisions; do
            for r in off on; do
                [ "$model" = gpt2-medium ] && [ "$p" = f16 ] && continue
                run "mem-$model-$p-$r" --model "$model" --data "$data/shakespeare.txt" \
                    --batch 4 --seq 256 --steps 4 --eval-every 0 --eval-batches 1 \
                    --precision "$p" --recompute "$r"
            done
        done
    done
fi
if [ "${CONVERGENCE:-1}" = 1 ]; then
    for seed in $seeds; do
        # The default seed keeps the names of the first reports.
        tag=$([ "$seed" = 1234 ] && echo "" || echo "-s$seed")
        for p in $precisions; do
            run "shakespeare-$p$tag" --data "$data/shakespeare.txt" --steps 600 --batch 16 \
                --seq 64 --eval-every 200 --precision "$p" --seed "$seed"
            run "fashion-$p$tag" --data "$data/fashion-mnist" --steps 1500 --batch 64 \
                --eval-every 500 --precision "$p" --seed "$seed"
        done
    done
fi
python3 - "$work" "$out" <<'EOF'
import glob, json, os, statistics, sys
work, out = sys.argv[1], sys.argv[2]
runs = {}
for f in sorted(glob.glob(os.path.join(work, "*.json"))):
    r = json.load(open(f))
    t = [s["elapsed_s"] for s in r["steps"]]
    gaps = [b - a for a, b in zip(t, t[1:])]
    last = r["evals"][-1] if r["evals"] else {}
    runs[os.path.basename(f)[:-5]] = {
        "backend": r["backend"],
        "steps": len(r["steps"]),
        "step_s_median_after_first": statistics.median(gaps) if gaps else None,
        "peak_rss_gb": (r["peak_rss_bytes"] or 0) / 1e9,
        "wall_s": r["wall_s"],
        "final_eval_loss": last.get("loss"),
        "final_eval_accuracy": last.get("accuracy"),
        "evals": r["evals"],
        "loss_scale": r.get("loss_scale"),
    }
print(f"{'run':<28} {'backend':<16} {'step s':>8} {'peak GB':>8} {'eval loss':>10} {'acc':>7}")
for k, v in runs.items():
    st = v["step_s_median_after_first"]
    print(f"{k:<28} {v['backend']:<16} {st if st is None else round(st, 2)!s:>8} "
          f"{v['peak_rss_gb']:>8.2f} {v['final_eval_loss'] or 0:>10.4f} "
          f"{v['final_eval_accuracy'] or 0:>7.4f}")
cpu = ""
try:
    cpu = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
except Exception:
    pass
json.dump({"machine": {"cpu": cpu, "threads": os.cpu_count()}, "runs": runs}, open(out, "w"), indent=1)
print(f"written to {out}")
EOF
