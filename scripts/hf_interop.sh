#!/usr/bin/env bash
# Makes a virtual environment with transformers, torch (CPU) and safetensors from PyPI and runs
# scripts/hf_interop.py: fusionllm against transformers (fixtures, logits, fine-tuning, export).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HF_VENV:-target/hf-venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet torch transformers safetensors
fi
exec "$venv/bin/python" scripts/hf_interop.py "$@"
