#!/usr/bin/env bash
# Create or reuse .venv and install meshtrain with pinned dependencies. Idempotent: a stamp holds
# the hash of pyproject.toml and the constraints, so a second run only checks it.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# The wheels bench/gpu_check.sh carries to the offline GPU machine; its test installs them offline too.
[ -n "$(ls .whl/*.whl 2>/dev/null)" ] || bash bench/gpu_wheels.sh .whl >/dev/null
stamp=.venv/.meshtrain-installed
want=$(cat pyproject.toml launch/constraints.txt | sha256sum | cut -d' ' -f1)
[ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && exit 0
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: an unpinned one pulls a multi-GB CUDA build. A torch already in the
# venv (a CUDA build on a GPU machine, say) is kept.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" torch==2.13.0
"${pip[@]}" -c launch/constraints.txt -e ".[test]"
echo "$want" > "$stamp"
