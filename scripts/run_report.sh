# Sourced by the benchmark scripts: `run NAME ARGS...` runs "$bin" "${common[@]}" ARGS with its
# report at $out/NAME.json and its log at $out/NAME.log, skipping a run whose report exists, and
# prints its last lines (or why it failed). Needs $bin, $out and the array `common`.
run() { # name, extra args...
  local name=$1; shift
  [ -s "$out/$name.json" ] && return 0
  if ! "$bin" "${common[@]}" --report "$out/$name.json" "$@" > "$out/$name.log" 2>&1; then
    echo "$name: failed (see $out/$name.log)"; tail -2 "$out/$name.log"
  else
    echo "$name: $(grep -E '^done:' "$out/$name.log"); $(grep 'final eval loss' "$out/$name.log")"
  fi
}
