#!/usr/bin/env bash
# Convergence of islands against one synchronous job at equal tokens (issue 16): gpt2-tiny on
# Shakespeare (bytes), 2 and 4 islands, H in {10, 50, 200}, DiLoCo's outer Nesterov SGD and plain
# averaging, pseudo-gradients dense, int8 and top-k 10%, in one process (`train --nodes 1 --islands N`: the arithmetic of islands on separate
# machines). Each report goes to docs/results/islands/; summarise with scripts/islands_summary.py.
# Usage: scripts/islands_sweep.sh [STEPS [OUT]]   (default 600 inner steps, docs/results/islands)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-600}
bin=target/release/fusionllm
out=${2:-docs/results/islands}
mkdir -p "$out"
cargo build --release --bin fusionllm
common=(train --nodes 1 --data ../shared/data/shakespeare.txt --tokenizer bytes --steps "$steps"
        --batch 16 --seq 64 --eval-every 100 --eval-batches 40)
# DiLoCo's published outer setting (the runs named -dense, -int8, -topk10); `train` defaults to
# plain averaging (the runs named -avg), so it is spelled out.
diloco=(--outer-lr 0.7 --outer-momentum 0.9)
. scripts/run_report.sh
run sync-2 --micro-batches 2
run sync-4 --micro-batches 4
for n in 2 4; do
  for h in 10 50 200; do
    run "islands$n-h$h-dense" --islands "$n" --outer-every "$h" "${diloco[@]}"
    # Plain averaging: outer SGD at rate 1 without momentum.
    run "islands$n-h$h-avg" --islands "$n" --outer-every "$h" --outer-lr 1 --outer-momentum 0
  done
  run "islands$n-h50-int8" --islands "$n" --outer-every 50 --outer-codec int8 "${diloco[@]}"
done
run islands2-h50-topk10 --islands 2 --outer-every 50 --outer-codec topk:0.1 "${diloco[@]}"
