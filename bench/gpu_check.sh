#!/usr/bin/env bash
# The GPU check for a lent single GPU: sets up .venv (pinned, idempotent), then bench/gpu_check.py
# (1.2B Llama and a small Qwen3-MoE: transformers eager vs meshtrain eager / compile / compile+float8).
# Under 8 minutes on one H100/H200; exits non-zero on any failure. Extra options go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
exec timeout 480 .venv/bin/python bench/gpu_check.py "$@"
