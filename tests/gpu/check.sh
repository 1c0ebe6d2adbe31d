#!/usr/bin/env bash
# The GPU check (tests/gpu/check.py): on a machine with an NVIDIA GPU, within 10 minutes, it builds a tiny engine
# set (or takes --engines DIR: an onnxruntime-portable set, the CPU parity reference), opens it on every GPU
# backend this machine can run (onnxruntime-cuda where onnxruntime-gpu has CUDA, tensorrt where tensorrt imports)
# and prints one summary table: build/open, parity against the CPU fp32 engine, CUDA-graph replay against plain
# passes, ms per pass with and without graphs, speculative speedups. --json PATH writes the table as JSON.
# Without a GPU it says so in one line and exits 0. On a GPU machine that reaches no package index,
# tests/gpu/carry.py brings onnxruntime-gpu over in parts first (its docstring lists the calls).
#   tests/gpu/check.sh [--engines DIR] [--source CHECKPOINT] [--draft CHECKPOINT] [--json PATH]
set -u
cd "$(dirname "$0")/../.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu check: no NVIDIA GPU here (no working nvidia-smi); nothing to check"
    exit 0
fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec timeout --kill-after=10 595 "$PY" tests/gpu/check.py "$@"
