#!/usr/bin/env bash
# What a lost node costs islands at a real size: gpt2-small as 2 islands of 2 stages (4 node
# processes on this machine, synchronised every EVERY = 10 steps), node1 SIGKILLed at step
# KILL_AT (default half-way through the second round; the launcher restarts it, so a
# replacement joins), once under each island recovery:
#   local    - only node1's island sits out until the next synchronisation; the other goes on
#   rollback - every island goes back to the last snapshot
# and once undisturbed. Reports land in $OUT/{none,local,rollback}.json; the table follows.
#
#   scripts/island_recovery.sh [STEPS]   (default 30; BIN, OUT, KILL_AT, DATA, EVERY, SEQ, RUNS
#                                          override; RUNS="local rollback" skips the undisturbed run)
set -euo pipefail
steps=${1:-30}
bin=${BIN:-target/release/fusionllm}
out=${OUT:-docs/results/island-recovery}
every=${EVERY:-10}
kill_at=${KILL_AT:-$((every + every / 2))}
data=${DATA:-../shared/data/shakespeare.txt}
mkdir -p "$out"
common=(train --model gpt2-small --data "$data" --nodes 4 --islands 2 --outer-every "$every"
  --steps "$steps" --batch 1 --seq "${SEQ:-128}" --micro-batches 2 --eval-every "$every"
  --eval-batches 4)

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

runs=${RUNS:-none local rollback}
for name in $runs; do
  case $name in
    none) run_one none local no ;;
    local) run_one local local yes ;;
    rollback) run_one rollback rollback yes ;;
  esac
done

python3 - "$out" $runs <<'EOF'
import json, sys
out = sys.argv[1]
print(f"{'run':<10} {'steps':>5} {'wall s':>8} {'lost':>5} {'island out':>10} {'recovery s':>10} {'reshapes':>8} {'eval loss':>9}")
for name in sys.argv[2:]:
    r = json.load(open(f"{out}/{name}.json"))
    rec = (r.get("recoveries") or [{}])[0]
    evals = r.get("evals") or [{}]
    out_island = rec.get("island_out")
    print(f"{name:<10} {len(r['steps']):>5} {r['wall_s']:>8.1f} {rec.get('steps_lost', 0):>5} "
          f"{'-' if out_island is None else out_island:>10} {rec.get('seconds', 0.0):>10.1f} "
          f"{len(r.get('reshapes') or []):>8} {evals[-1].get('loss', float('nan')):>9.4f}")
EOF
