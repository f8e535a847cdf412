#!/usr/bin/env bash
# Streaming outer synchronisation (`train --outer-fragments F`) against whole-model
# synchronisation on the emulated slow-link testbed (testbeds/slow-link.toml: 4 node processes,
# 1 Gbit/s inside two sites, 10 Mbit/s and 30 ms between them), gpt2-tiny on Shakespeare
# (bytes), batch 8 x 64, set up as scripts/islands_overlap.sh: the synchronous OP-Fence job
# (STEPS steps, its final eval loss is the target) and two islands (one 2-stage pipeline per
# site) averaging every 25 steps, given 4x the steps, evaluations and snapshots every 100 steps
# (their synchronisations take the whole model and block). The streaming runs cut the model into
# 5 fragments and synchronise one every 5 steps, so each fragment is still synchronised every
# 25 steps while an exchange carries a fifth of the model.
# Reports go to docs/results/islands-streaming/; summarise with
#   python3 scripts/islands_wallclock.py docs/results/islands-streaming docs/plots/islands-streaming-seconds.svg
# Usage: scripts/islands_streaming.sh [STEPS]   (default 300). Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-300}
bin=target/release/fusionllm
out=docs/results/islands-streaming
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
run islands-h25-f5-int8 "${islands[@]}" --outer-codec int8 --outer-fragments 5
run islands-h25-f5-int8-overlap "${islands[@]}" --outer-codec int8 --outer-fragments 5 --outer-overlap
run islands-h25-avg "${islands[@]}"
run islands-h25-avg-overlap "${islands[@]}" --outer-overlap
run islands-h25-f5 "${islands[@]}" --outer-fragments 5
run islands-h25-f5-overlap "${islands[@]}" --outer-fragments 5 --outer-overlap
