#!/usr/bin/env bash
# The GPU checks and the gpt2-small step of docs/BENCHMARKS.md ("On a GPU"), on a machine with an
# NVIDIA GPU; PyTorch in `python3` for the peer figures.
#
#   CUDA_COMPUTE_CAP=90 bash scripts/gpu_bench.sh [OUT_DIR]            # builds here (nvcc, Rust)
#   BIN_DIR=dir bash scripts/gpu_bench.sh [OUT_DIR]                    # binaries built elsewhere
#
# BIN_DIR holds `fusionllm` built with `--features cuda` and the test binaries `gradcheck`
# (fusion-ops), `whole_graph_gradcheck` and `recompute` (fusion-exec) and `resident`
# (fusion-train), built with `--features fusion-backend/cuda`: that is how the figures in
# docs/results/gpu-h100.json were made, on a machine without a GPU (CUDA 13.0 from PyPI's
# nvidia-cuda-nvcc, -nvvm, -crt, -runtime, -cccl, -nvrtc, -cublas and -curand wheels as
# CUDA_ROOT, a stub libcuda.so for linking) and run on a lent GPU machine.
set -uo pipefail
out=${1:-gpu-results}
mkdir -p "$out"
if [ -z "${BIN_DIR:-}" ]; then
    set -e
    cargo build --release --bin fusionllm --features cuda
    BIN_DIR=target/release
    run_test() { FUSION_TEST_DEVICE=cuda cargo test --release --features fusion-backend/cuda \
        -p "$1" --test "$2"; }
    set +e
else
    run_test() { FUSION_TEST_DEVICE=cuda "$BIN_DIR/$2"; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
echo "== gradient checks, recomputation and the device optimizer on the GPU"
for t in ${GPU_TESTS:-fusion-ops:gradcheck fusion-exec:whole_graph_gradcheck fusion-exec:recompute \
    fusion-train:resident}; do
    echo "-- ${t#*:}"
    run_test "${t%%:*}" "${t#*:}" 2>&1 | tail -25 || status=1
done
echo "== gpt2-small step (batch 4 x 256, GPT-2 vocabulary): optimizer on the device / host; TF32, bf16, f16"
# Each run is PLACE[-MODE]: the optimizer on the device or the host, MODE tf32, bf16 or f16.
RUNS=${RUNS:-device host device-tf32 device-bf16 device-f16 host-bf16}
for run in $RUNS; do
    on=${run%%-*}
    mode=${run#"$on"}; mode=${mode#-}
    extra=()
    case "$mode" in
        tf32) extra=(--tf32) ;;
        bf16|f16) extra=(--precision "$mode") ;;
    esac
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$out/smi-$run.csv" &
    smi=$!
    "$BIN_DIR/fusionllm" train --nodes 1 --backend candle-cuda --model gpt2-small \
        --data docs/BENCHMARKS.md --tokenizer gpt2 --batch 4 --seq 256 --steps 12 --warmup 2 \
        --eval-every 0 --eval-batches 1 --optimizer-on "$on" "${extra[@]}" \
        --report "$out/fusionllm-$run.json" >"$out/train-$run.log" 2>&1 \
        || { status=1; tail -20 "$out/train-$run.log"; }
    kill "$smi"
    echo "peak GPU memory ($run): $(sort -n "$out/smi-$run.csv" | tail -1) MiB"
done
python3 - "$out" $RUNS <<'PY'
import json, statistics, sys, os
for run in sys.argv[2:]:
    p = os.path.join(sys.argv[1], f"fusionllm-{run}.json")
    if not os.path.exists(p):
        continue
    r = json.load(open(p))
    s = r["steps"]
    d = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(s, s[1:])]
    ev = r["evals"][-1]["loss"] if r.get("evals") else float("nan")
    print(f"fusionllm median step ({run}, steps 4-12): {statistics.median(d[2:]):.4f} s, "
          f"final eval loss {ev:.5f}")
PY
echo "== PyTorch on the same GPU"
# Each is MODE[-PRECISION]: eager or compile; tf32, or bf16 / f16 autocast (mixed precision).
for run in ${TORCH_RUNS:-eager compile eager-tf32 compile-tf32 eager-bf16 compile-bf16 eager-f16}; do
    mode=${run%%-*}
    prec=${run#"$mode"}; prec=${prec#-}
    flag=(); [ "$mode" = compile ] && flag=(--compile)
    case "$prec" in
        tf32) flag+=(--tf32) ;;
        bf16|f16) flag+=(--amp "$prec") ;;
    esac
    python3 scripts/peer_gpt2_step.py --device cuda --steps 10 "${flag[@]}" \
        --json "$out/torch-$run.json" || status=1
done
exit $status
