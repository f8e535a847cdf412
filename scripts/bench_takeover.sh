#!/usr/bin/env bash
# Recovery time of a standby broker: a real etcd, two brokers of one job campaigning in it (the
# leader serves, the standby waits), three reference-backend nodes given both brokers' URLs. The
# leader is SIGKILLed past step KILL_AT; the script times the standby's election, its resume from
# the newest checkpoint and its first step, for each lease TTL given. Prints a table and writes
# JSON.
#
#   scripts/bench_takeover.sh [--ttl "5 2"] [--steps 200] [--kill-at 100] [--json OUT]
#
# Needs etcd (Debian's etcd-server) and a built binary ($FUSIONLLM, default target/debug/fusionllm,
# which the test profile optimises: cargo build --profile test -p fusion-cli).
set -euo pipefail
cd "$(dirname "$0")/.."
TTLS="5 2"; STEPS=200; KILL_AT=100; JSON=""
while [ $# -gt 0 ]; do
    case "$1" in
        --ttl) TTLS="$2"; shift 2 ;;
        --steps) STEPS="$2"; shift 2 ;;
        --kill-at) KILL_AT="$2"; shift 2 ;;
        --json) JSON="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
BIN=${FUSIONLLM:-target/debug/fusionllm}
ETCD=${ETCD:-$(command -v etcd || echo /usr/bin/etcd)}
[ -x "$BIN" ] || { echo "no $BIN (cargo build --profile test -p fusion-cli)" >&2; exit 1; }
[ -x "$ETCD" ] || { echo "no etcd (apt-get install etcd-server)" >&2; exit 1; }
WORK=$(mktemp -d)
PIDS=()
stop_all() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; PIDS=(); }
cleanup() { stop_all; kill -9 "${ETCD_PID:-0}" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now() { date +%s.%N; }
# Each line of a broker's output, stamped with the time it was read.
stamp() { while IFS= read -r l; do echo "$(now) $l"; done; }
# Waits (at most 300 s) until FILE has a line matching PATTERN; prints that line's stamp.
wait_line() {
    local file=$1 pattern=$2
    for _ in $(seq 3000); do
        if grep -q -- "$pattern" "$file" 2>/dev/null; then
            grep -m1 -- "$pattern" "$file" | cut -d' ' -f1; return 0
        fi
        sleep 0.1
    done
    echo "timed out waiting for '$pattern' in $file" >&2; tail -20 "$file" >&2; exit 1
}

export FUSIONLLM_TOKEN=bench-takeover-token-0123
"$BIN" cert --out "$WORK/certs" --names broker,node0,node1,node2 >/dev/null
EP=$(free_port); PP=$(free_port)
"$ETCD" --data-dir "$WORK/etcd" --listen-client-urls "http://127.0.0.1:$EP" \
    --advertise-client-urls "http://127.0.0.1:$EP" --listen-peer-urls "http://127.0.0.1:$PP" \
    --initial-advertise-peer-urls "http://127.0.0.1:$PP" \
    --initial-cluster "default=http://127.0.0.1:$PP" >"$WORK/etcd.log" 2>&1 &
ETCD_PID=$!
for _ in $(seq 100); do
    python3 -c "import urllib.request; urllib.request.urlopen(urllib.request.Request('http://127.0.0.1:$EP/v3/kv/range', b'{\"key\":\"AA==\"}'), timeout=1)" 2>/dev/null && break
    sleep 0.2
done
ROWS=()
for TTL in $TTLS; do
    RUN="$WORK/ttl$TTL"; mkdir -p "$RUN"
    cat >"$RUN/job.toml" <<EOF
model = "gpt2-tiny"
nodes = 3
probe_links = false
[train]
steps = $STEPS
checkpoint_every = 10
checkpoint_dir = "$RUN/ckpt"
EOF
    PA=$(free_port); PB=$(free_port)
    common=(--job "$RUN/job.toml" --certs "$WORK/certs" --etcd "http://127.0.0.1:$EP"
        --election "bench/ttl$TTL" --lease-ttl "$TTL" --node-timeout 5 --report "$RUN/report.json")
    ("$BIN" broker --listen "127.0.0.1:$PA" "${common[@]}" 2>&1 | stamp >"$RUN/a.log") &
    wait_line "$RUN/a.log" "broker listening" >/dev/null
    LEADER=$(pgrep -f -- "--listen 127.0.0.1:$PA" | head -1 || true)
    [ -n "$LEADER" ] || { echo "the leader's process is gone" >&2; exit 1; }
    ("$BIN" broker --listen "127.0.0.1:$PB" "${common[@]}" 2>&1 | stamp >"$RUN/b.log") &
    wait_line "$RUN/b.log" "standing by" >/dev/null
    STANDBY=$(pgrep -f -- "--listen 127.0.0.1:$PB" | head -1 || true)
    [ -n "$STANDBY" ] || { echo "the standby's process is gone" >&2; exit 1; }
    PIDS+=("$LEADER" "$STANDBY")
    for n in node0 node1 node2; do
        "$BIN" node --broker "https://127.0.0.1:$PA,https://127.0.0.1:$PB" --name $n \
            --certs "$WORK/certs" --backend reference --data-listen 127.0.0.1:0 \
            >"$RUN/$n.log" 2>&1 &
        PIDS+=($!)
    done
    wait_line "$RUN/a.log" "step *$KILL_AT/$STEPS" >/dev/null
    T0=$(now); kill -9 "$LEADER"
    T1=$(wait_line "$RUN/b.log" "elected leader")
    T2=$(wait_line "$RUN/b.log" "resumed from")
    FROM=$(grep -m1 "resumed from" "$RUN/b.log" | awk '{print $NF}')
    wait_line "$RUN/b.log" "^[0-9.]* done:" >/dev/null
    for _ in $(seq 100); do [ -s "$RUN/report.json" ] && break; sleep 0.1; done
    ROWS+=("$(python3 - "$RUN/report.json" "$TTL" "$T0" "$T1" "$T2" "$FROM" "$KILL_AT" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
ttl, t0, t1, t2, frm, kill_at = sys.argv[2], *map(float, sys.argv[3:6]), int(sys.argv[6]), int(sys.argv[7])
steps = r["steps"]
first = steps[0]
times = sorted(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:]))
print(json.dumps({
    "lease_ttl_s": int(ttl), "killed_after_step": kill_at, "resumed_from_step": frm,
    "steps_lost": kill_at - frm, "kill_to_elected_s": round(t1 - t0, 2),
    "elected_to_resumed_s": round(t2 - t1, 2),
    "resumed_to_first_step_s": round(first["elapsed_s"], 2),
    "kill_to_first_step_s": round(t2 - t0 + first["elapsed_s"], 2),
    "median_step_s": round(times[len(times) // 2], 3) if times else None,
    "final_step": steps[-1]["step"], "run_id": r.get("run_id"),
}))
EOF
)")
    stop_all
done
python3 - "$JSON" "${ROWS[@]}" <<'EOF'
import json, sys
out, rows = sys.argv[1], [json.loads(r) for r in sys.argv[2:]]
print("| lease TTL | killed after step | resumed from | kill → elected | elected → resumed | resumed → first step | kill → first step | median step |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['lease_ttl_s']} s | {r['killed_after_step']} | {r['resumed_from_step']} | {r['kill_to_elected_s']} s "
          f"| {r['elected_to_resumed_s']} s | {r['resumed_to_first_step_s']} s | {r['kill_to_first_step_s']} s | {r['median_step_s']} s |")
if out:
    json.dump(rows, open(out, "w"), indent=2)
    print(f"written to {out}")
EOF
