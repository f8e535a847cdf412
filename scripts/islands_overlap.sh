#!/usr/bin/env bash
# Blocking against overlapped outer synchronisation (`train --outer-overlap`) on the emulated
# slow-link testbed (testbeds/slow-link.toml: 4 node processes, 1 Gbit/s inside two sites,
# 10 Mbit/s and 30 ms between them), gpt2-tiny on Shakespeare (bytes), batch 8 x 64: the
# synchronous OP-Fence job (STEPS steps, its final eval loss is the target) and two islands (one
# 2-stage pipeline per site) averaging every 25 steps, dense and int8, each blocking and
# overlapped, given 4x the steps. Evaluations come every 100 steps: a synchronisation before an
# evaluation blocks even with --outer-overlap (so that the evaluated model is the average), and
# evaluating every 25 steps would make every synchronisation block. Snapshots come with the
# evaluations (--snapshot-every 100): an adaptive interval would block other synchronisations
# too (the first one, in our runs), and which synchronisations block changes the trajectory
# (docs/BENCHMARKS.md), so the islands run the schedule the one-process trainer runs.
# Reports go to docs/results/islands-overlap/; summarise with
#   python3 scripts/islands_wallclock.py docs/results/islands-overlap docs/plots/islands-overlap-seconds.svg
# Usage: scripts/islands_overlap.sh [STEPS]   (default 300). Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-300}
bin=target/release/fusionllm
out=docs/results/islands-overlap
mkdir -p "$out"
cargo build --release --bin fusionllm
common=(train --testbed testbeds/slow-link.toml --data ../shared/data/shakespeare.txt --tokenizer bytes
        --batch 8 --eval-every 100 --eval-batches 20)
. scripts/run_report.sh
long=$((4 * steps))
islands=(--steps "$long" --islands 2 --micro-batches 2 --outer-every 25 --outer-lr 1 --outer-momentum 0
         --snapshot-every 100)
run sync --steps "$steps" --micro-batches 4
run islands-h25-avg-int8 "${islands[@]}" --outer-codec int8
run islands-h25-avg-int8-overlap "${islands[@]}" --outer-codec int8 --outer-overlap
run islands-h25-avg "${islands[@]}"
run islands-h25-avg-overlap "${islands[@]}" --outer-overlap
