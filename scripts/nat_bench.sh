#!/usr/bin/env bash
# Homes behind NAT on the faithful emulation (root, nftables): what each path costs a training run.
#
# 1. Paths: two- and three-stage gpt2-tiny pipelines (2 x 128 tokens per micro-batch, 4
#    micro-batches, 1F1B) whose stages sit on separate sites joined by 50 Mbit/s, 20 ms links,
#    with the devices behind the NAT a run needs, against the same devices all public:
#      direct    lab0 -> lab1 (both public)
#      reversed  lab0 and home-a (port-restricted NAT): the home dials the lab for both directions
#      punched   home-a, home-b (both port-restricted) and lab0: home-a <-> home-b by TCP
#                simultaneous open through both NATs (lab0 is needed: the homes learn their
#                public address and whether their NAT keeps ports from probing a public node)
#      relayed   home-a, home-c (symmetric NAT) and lab0: home-a <-> home-c through lab0's relay
#    The step time (median of the steps after the first) against the all-public run gives the
#    path's added cost; the relayed link crosses the relay's two links (twice the latency).
# 2. paper-c-like: testbeds/homes-nat.toml (testbeds/homes.toml: a lab of 2 on 1 Gbit/s, homes
#    on 20 and 8 Mbit/s uplinks, with its homes behind a port-restricted and a symmetric NAT),
#    OP-Fence placing the stages with the paths' figures, against homes.toml all public.
#
# Prints a table and writes docs/results/nat-paths.json. Usage: scripts/nat_bench.sh [STEPS]
# (default 8); RESUME=1 keeps the runs whose reports exist. Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
bin=target/release/fusionllm
out=docs/results/nat-paths
mkdir -p "$out"
cargo build --release --bin fusionllm
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# A testbed of the named devices (name:nat), one site each, every pair 50 Mbit/s and 20 ms apart.
testbed() {
  local file=$1; shift
  {
    echo 'name = "paths"'
    echo 'description = "one device per site, 50 Mbit/s and 20 ms between sites"'
    for d in "$@"; do
      echo "[[site]]"; echo "name = \"s-${d%%:*}\""
      echo 'internal = { bandwidth_mbps = 1000.0, latency_ms = 0.2 }'
    done
    local names=("$@")
    for ((i = 0; i < ${#names[@]}; i++)); do
      for ((j = i + 1; j < ${#names[@]}; j++)); do
        echo "[[link]]"; echo "between = [\"s-${names[i]%%:*}\", \"s-${names[j]%%:*}\"]"
        echo "bandwidth_mbps = 50.0"; echo "latency_ms = 20.0"
      done
    done
    for d in "$@"; do
      echo "[[device]]"; echo "name = \"${d%%:*}\""; echo "site = \"s-${d%%:*}\""
      if [ "${d#*:}" != "$d" ]; then echo "nat = \"${d#*:}\""; fi
    done
  } > "$file"
}

train() {
  local name=$1 testbed=$2 nodes=$3; shift 3
  if [ -f "$out/$name.json" ] && [ -n "${RESUME:-}" ]; then echo "== $name (kept)"; return; fi
  echo "== $name"
  "$bin" train --faithful --testbed "$testbed" --nodes "$nodes" --steps "$steps" \
    --batch 2 --seq 128 --micro-batches 4 --eval-every 1000 --eval-batches 1 \
    --report "$out/$name.json" "$@" > "$out/$name.log" 2>&1
}

paths=(
  "direct|lab0 lab1|lab0 lab1"
  "reversed|home-a:port-restricted lab0|home-a lab0"
  "punched|home-a:port-restricted home-b:port-restricted lab0|home-a home-b lab0"
  "relayed|home-a:port-restricted home-c:symmetric lab0|home-a home-c lab0"
)
for p in "${paths[@]}"; do
  IFS='|' read -r name nat public <<< "$p"
  read -ra nat_devices <<< "$nat"
  read -ra public_devices <<< "$public"
  testbed "$tmp/$name-nat.toml" "${nat_devices[@]}"
  testbed "$tmp/$name-public.toml" "${public_devices[@]}"
  train "$name" "$tmp/$name-nat.toml" "${#nat_devices[@]}" --scheduler even
  train "$name-public" "$tmp/$name-public.toml" "${#public_devices[@]}" --scheduler even
done

train paper-c-nat testbeds/homes-nat.toml 4
train paper-c-public testbeds/homes.toml 4

python3 - "$out" docs/results/nat-paths.json <<'EOF'
import json, statistics, sys, pathlib
out, dest = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = []
for name in ["direct", "reversed", "punched", "relayed", "paper-c"]:
    pair = {}
    for kind, suffix in [("nat", "-nat" if name == "paper-c" else ""), ("public", "-public")]:
        r = json.loads((out / f"{name}{suffix}.json").read_text())
        walls = [t["wall_s"] for t in r["timings"][1:]] or [t["wall_s"] for t in r["timings"]]
        paths = sorted({l["path"] for l in r["links"]})
        pair[kind] = {"step_s": statistics.median(walls), "paths": paths,
                      "losses": [s["loss"] for s in r["steps"]]}
    added = pair["nat"]["step_s"] - pair["public"]["step_s"]
    rows.append({"run": name, "nat_step_s": pair["nat"]["step_s"],
                 "public_step_s": pair["public"]["step_s"], "added_s": added,
                 "paths": pair["nat"]["paths"],
                 "same_losses": pair["nat"]["losses"] == pair["public"]["losses"]})
print(f"{'run':<10} {'behind NAT s/step':>18} {'all public s/step':>18} {'added s':>9}  same losses  paths")
for r in rows:
    print(f"{r['run']:<10} {r['nat_step_s']:>18.3f} {r['public_step_s']:>18.3f} {r['added_s']:>9.3f}"
          f"  {str(r['same_losses']):<11}  {', '.join(r['paths'])}")
json.dump({"rows": rows}, open(dest, "w"), indent=2)
EOF
