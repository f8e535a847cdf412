#!/usr/bin/env bash
# The paper-c-like home run (testbeds/homes.toml: a lab of two devices on 1 Gbit/s and two homes
# on 20 and 8 Mbit/s uplinks whose devices emulate 2x slower ones), gpt2-tiny on Shakespeare
# (bytes), 8 x 64 tokens per micro-batch, 8 micro-batches per step in every run:
#   sync:    the naive even split of the model over the 4 nodes in name order, uncompressed
#            (STEPS steps; its final eval loss is the target);
#   islands: every node an island of its own (2 micro-batches each on average, shares in
#            proportion to measured speed), int8 pseudo-gradients every 25 steps, plain
#            averaging, given 4x the steps; wall-clock is read where it first reaches the target.
# Reports go to docs/results/homes-wallclock/; summarise with
#   python3 scripts/islands_wallclock.py docs/results/homes-wallclock docs/plots/homes-wallclock-seconds.svg
# Usage: scripts/homes_wallclock.sh [STEPS]   (default 100). Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-100}
bin=target/release/fusionllm
out=docs/results/homes-wallclock
mkdir -p "$out"
cargo build --release --bin fusionllm
common=(train --testbed testbeds/homes.toml --data ../shared/data/shakespeare.txt --tokenizer bytes
        --batch 8 --eval-every 25 --eval-batches 20)
. scripts/run_report.sh
run sync --steps "$steps" --micro-batches 8 --scheduler even --compress none
run islands-h25-int8 --steps $((4 * steps)) --islands 4 --micro-batches 2 --outer-every 25 \
  --outer-lr 1 --outer-momentum 0 --outer-codec int8 --island-shares auto
