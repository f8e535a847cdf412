#!/usr/bin/env bash
# The GPU checks and the gpt2-small step of docs/BENCHMARKS.md ("On a GPU"), on a machine with an
# NVIDIA GPU, the CUDA toolkit (nvcc) and Rust; PyTorch in `python3` for the peer figures.
#
#   CUDA_COMPUTE_CAP=90 bash scripts/gpu_bench.sh [OUT_DIR]
#
# docs/results/gpu-h100.json came from these commands, with the binaries built on a machine
# without a GPU (CUDA 13.0 from PyPI's nvidia-cuda-nvcc, -nvvm, -crt, -runtime, -cccl and -nvrtc
# wheels as CUDA_HOME, the driver's stub libraries on LIBRARY_PATH) and run on the GPU machine.
set -euo pipefail
out=${1:-gpu-results}
mkdir -p "$out"
cargo build --release --bin fusionllm --features cuda
echo "== gradient checks and recomputation on the GPU"
FUSION_TEST_DEVICE=cuda cargo test --release --features fusion-backend/cuda \
    -p fusion-ops --test gradcheck
FUSION_TEST_DEVICE=cuda cargo test --release --features fusion-backend/cuda \
    -p fusion-exec --test whole_graph_gradcheck --test recompute
echo "== gpt2-small step (batch 4 x 256, GPT-2 vocabulary), storing and recomputing"
for r in off on; do
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$out/smi-$r.csv" &
    smi=$!
    target/release/fusionllm train --nodes 1 --backend candle-cuda --model gpt2-small \
        --data docs/BENCHMARKS.md --tokenizer gpt2 --batch 4 --seq 256 --steps 10 --warmup 2 \
        --eval-every 0 --eval-batches 1 --recompute "$r" --report "$out/fusionllm-$r.json"
    kill "$smi"
    echo "peak GPU memory ($r): $(sort -n "$out/smi-$r.csv" | tail -1) MiB"
done
python3 - "$out/fusionllm-off.json" <<'PY'
import json, statistics, sys
s = json.load(open(sys.argv[1]))["steps"]
d = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(s, s[1:])]
print(f"fusionllm median step (steps 4-10): {statistics.median(d[2:]):.3f} s")
PY
echo "== PyTorch on the same GPU"
python3 scripts/peer_gpt2_step.py --device cuda --steps 10 --json "$out/torch-eager.json"
python3 scripts/peer_gpt2_step.py --device cuda --steps 10 --compile --json "$out/torch-compile.json"
