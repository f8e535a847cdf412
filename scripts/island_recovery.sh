#!/usr/bin/env bash
# What a lost node costs islands at a real size: gpt2-small as 2 islands of 2 stages (4 node
# processes on this machine, synchronised every 10 steps), node1 SIGKILLed at step KILL_AT (the
# launcher restarts it, so a replacement joins), once under each island recovery:
#   local    - only node1's island sits out until the next synchronisation; the other goes on
#   rollback - every island goes back to the last snapshot
# and once undisturbed. Reports land in $OUT/{none,local,rollback}.json; the table follows.
#
#   scripts/island_recovery.sh [STEPS]        (default 30; BIN, OUT, KILL_AT, DATA override)
set -euo pipefail
steps=${1:-30}
bin=${BIN:-target/release/fusionllm}
out=${OUT:-docs/results/island-recovery}
kill_at=${KILL_AT:-15}
data=${DATA:-../shared/data/shakespeare.txt}
mkdir -p "$out"
common=(train --model gpt2-small --data "$data" --nodes 4 --islands 2 --outer-every 10
  --steps "$steps" --batch 1 --seq 128 --micro-batches 2 --eval-every 10 --eval-batches 4)

# name, recovery, kill (yes/no): one run, node1 killed once the broker reports step $kill_at.
run_one() {
  local name=$1 recovery=$2 kill=$3
  [ -s "$out/$name.json" ] && return 0
  "$bin" "${common[@]}" --island-recovery "$recovery" --report "$out/$name.json" \
    > "$out/$name.log" 2>&1 &
  local pid=$! killed=no
  while kill -0 "$pid" 2> /dev/null; do
    if [ "$kill" = yes ] && [ "$killed" = no ] && awk -v k="$kill_at" \
      '/^step +[0-9]+\//{ split($2, a, "/"); if (a[1] + 0 >= k) f = 1 } END { exit !f }' \
      "$out/$name.log"; then
      pkill -KILL -f "fusionllm node .*--name node1( |$)" && killed=yes
    fi
    sleep 0.2
  done
  wait "$pid" || { echo "$name: failed (see $out/$name.log)"; tail -3 "$out/$name.log"; return 1; }
}

run_one none local no
run_one local local yes
run_one rollback rollback yes

python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
print(f"{'run':<10} {'steps':>5} {'wall s':>8} {'lost':>5} {'island out':>10} {'recovery s':>10} {'reshapes':>8} {'eval loss':>9}")
for name in ("none", "local", "rollback"):
    r = json.load(open(f"{out}/{name}.json"))
    rec = (r.get("recoveries") or [{}])[0]
    evals = r.get("evals") or [{}]
    out_island = rec.get("island_out")
    print(f"{name:<10} {len(r['steps']):>5} {r['wall_s']:>8.1f} {rec.get('steps_lost', 0):>5} "
          f"{'-' if out_island is None else out_island:>10} {rec.get('seconds', 0.0):>10.1f} "
          f"{len(r.get('reshapes') or []):>8} {evals[-1].get('loss', float('nan')):>9.4f}")
EOF
