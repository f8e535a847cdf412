#!/usr/bin/env bash
# Peak resident memory of every fusionllm process of a local-cluster run (the launcher, which is
# the broker, and each node), sampled once a second from /proc/PID/status (VmHWM, the kernel's
# own high-water mark). Usage: scripts/cluster_memory.sh OUT.json -- fusionllm train ARGS...
# Prints a table and writes OUT.json.
set -euo pipefail
out=$1; shift
[ "$1" = "--" ] && shift
"$@" &
launcher=$!
declare -A peak role
while kill -0 "$launcher" 2>/dev/null; do
  for pid in $(pgrep -f fusionllm || true); do
    st=/proc/$pid/status
    [ -r "$st" ] || continue
    # Only fusionllm processes themselves (not this script or its subshells).
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null || true)
    [ "${exe##*/}" = fusionllm ] || continue
    hwm=$(awk '/^VmHWM/ {print $2}' "$st" 2>/dev/null || true)
    [ -n "$hwm" ] || continue
    cmd=$(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null || true)
    case "$cmd" in
      *" node "*) r=$(sed -n 's/.*--name \([^ ]*\).*/\1/p' <<<"$cmd") ;;
      *" train "*|*" broker "*) r=broker ;;
      *) continue ;;
    esac
    role[$pid]=$r
    if [ -z "${peak[$pid]:-}" ] || [ "$hwm" -gt "${peak[$pid]}" ]; then peak[$pid]=$hwm; fi
  done
  sleep 1
done
status=0; wait "$launcher" || status=$?
printf '%-10s %12s\n' process "peak RSS MiB"
json="{\"exit_status\": $status, \"peak_rss_mib\": {"
sep=""
for pid in "${!peak[@]}"; do
  mib=$(( ${peak[$pid]} / 1024 ))
  printf '%-10s %12d\n' "${role[$pid]}" "$mib"
  json+="$sep\"${role[$pid]}\": $mib"; sep=", "
done
echo "$json}}" > "$out"
