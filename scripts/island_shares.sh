#!/usr/bin/env bash
# Islands of different speed, equal batch shares against automatic ones, on the emulated
# testbeds/uneven-sites.toml (4 node processes at two sites, 10 Mbit/s and 30 ms between them;
# the home site's two devices emulate devices 3x slower than the lab's). gpt2-tiny on Shakespeare
# (bytes), two islands (one 2-stage pipeline per site) of 4 micro-batches of 8 x 64 tokens on
# average, synchronised every 25 steps by plain averaging with int8 pseudo-gradients, the same
# steps and tokens for every run. Reports go to docs/results/island-shares/.
# Usage: scripts/island_shares.sh [STEPS]   (default 400). Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-400}
bin=target/release/fusionllm
out=docs/results/island-shares
mkdir -p "$out"
cargo build --release --bin fusionllm
common=(train --testbed testbeds/uneven-sites.toml --data ../shared/data/shakespeare.txt --tokenizer bytes
        --batch 8 --islands 2 --micro-batches 4 --outer-every 25 --outer-codec int8
        --steps "$steps" --eval-every 50 --eval-batches 20)
. scripts/run_report.sh
for shares in equal auto; do
  run "$shares" --island-shares "$shares"
done
python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
print("| shares | final shares | wall-clock s | tokens/s | final eval loss | re-balanced |")
print("|---|---|---:|---:|---:|---|")
for name in ["equal", "auto"]:
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p):
        continue
    r = json.load(open(p))
    o = r["outer"]
    shares = "/".join(str(s) for s in o["shares"])
    moves = "; ".join(o.get("rebalances", [])) or "-"
    c = r["config"]
    tokens = len(r["steps"]) * c["batch_size"] * c["seq_len"] * c["micro_batches"] * o["islands"]
    print(f"| {name} | {shares} | {r['wall_s']:.0f} | {tokens / r['wall_s']:.0f} | {r['evals'][-1]['loss']:.4f} | {moves} |")
PY
