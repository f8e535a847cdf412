#!/usr/bin/env bash
# Streaming synchronisation over several seeds, in one process (the island trainer runs the
# cluster's arithmetic without a network): the int8 setting of scripts/islands_streaming.sh
# (two islands averaging every 25 steps, 1200 steps, evaluations every 100) with 5 fragments and
# with the whole model, each blocking and overlapped, at seeds 1234 (the default), 1, 2 and 3.
# Reports go to docs/results/islands-streaming-seeds/. Usage: scripts/islands_streaming_seeds.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/fusionllm
out=docs/results/islands-streaming-seeds
mkdir -p "$out"
cargo build --release --bin fusionllm
common=(train --nodes 1 --islands 2 --outer-every 25 --outer-codec int8 --outer-lr 1 --outer-momentum 0
        --data ../shared/data/shakespeare.txt --tokenizer bytes --batch 8 --micro-batches 2 --steps 1200
        --eval-every 100 --eval-batches 20)
. scripts/run_report.sh
for seed in 1234 1 2 3; do
  run "f5-int8-seed$seed" --seed "$seed" --outer-fragments 5
  run "f5-int8-overlap-seed$seed" --seed "$seed" --outer-fragments 5 --outer-overlap
  run "whole-int8-seed$seed" --seed "$seed"
  run "whole-int8-overlap-seed$seed" --seed "$seed" --outer-overlap
done
