#!/usr/bin/env bash
# Wall-clock to a target evaluation loss on the emulated slow-link testbed (testbeds/slow-link.toml:
# 4 node processes, 1 Gbit/s inside two sites, 10 Mbit/s and 30 ms between them), gpt2-tiny on
# Shakespeare (bytes), equal tokens per step: one synchronous job placed by OP-Fence (STEPS steps)
# against two islands (one pipeline per site) synchronised every H steps, dense and int8, given
# 4x the steps so that they reach the synchronous job's final loss (the target; wall-clock is
# read where each run first reaches it). Reports go to docs/results/islands-wallclock/;
# summarise with scripts/islands_wallclock.py.
# Usage: scripts/islands_wallclock.sh [STEPS]   (default 300). Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-300}
bin=target/release/fusionllm
out=docs/results/islands-wallclock
mkdir -p "$out"
cargo build --release --bin fusionllm
common=(train --testbed testbeds/slow-link.toml --data ../shared/data/shakespeare.txt --tokenizer bytes
        --batch 8 --eval-every 25 --eval-batches 20)
. scripts/run_report.sh
long=$((4 * steps))
run sync --steps "$steps" --micro-batches 4
run islands-h25-avg --steps "$long" --islands 2 --micro-batches 2 --outer-every 25 --outer-lr 1 --outer-momentum 0
run islands-h25-avg-int8 --steps "$long" --islands 2 --micro-batches 2 --outer-every 25 --outer-lr 1 --outer-momentum 0 --outer-codec int8
run islands-h25-avg-topk10 --steps "$long" --islands 2 --micro-batches 2 --outer-every 25 --outer-lr 1 --outer-momentum 0 --outer-codec topk:0.1
# DiLoCo's outer setting, for comparison:
# run islands-h25-diloco --steps "$long" --islands 2 --micro-batches 2 --outer-every 25 --outer-lr 0.7 --outer-momentum 0.9
