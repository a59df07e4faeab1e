#!/usr/bin/env bash
# The GPU check on the lent GPU machine as it is: no network, its own Python 3.12 with a CUDA torch and
# transformers preinstalled (its python3 is itself a venv, /opt/torch/.venv). Nothing of the image is
# replaced: what it lacks (tyro and its two dependencies, torchdata, torchao) is installed from the wheels
# in .whl/ (bash bench/gpu_wheels.sh, run beforehand where the network is; carry .whl with the tree) with
# pip --no-index --no-deps into a folder of its own, .gpu-site/, put on PYTHONPATH beside the repository.
# Then bench/gpu_check.py, under 8 minutes; exits non-zero on any failure, and says in one line what it
# cannot do. Extra options go to gpu_check.py (--tiny: the same plumbing at toy sizes, on CPU).
#   GPU_CHECK_PYTHON  the image's python (python3)  GPU_CHECK_WHEELS  the wheels (.whl)  GPU_CHECK_SITE  (.gpu-site)
set -uo pipefail
cd "$(dirname "$0")/.."
python=${GPU_CHECK_PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-.whl}
site=${GPU_CHECK_SITE:-$PWD/.gpu-site}
fail() { echo "gpu_check: $*" >&2; exit 2; }

versions() { "$python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'; }
image=$(versions 2>/dev/null) || fail "$python has no torch or no transformers: this check runs on the image's own (set GPU_CHECK_PYTHON)"
echo "gpu_check: the image's $image ($("$python" --version 2>&1))"
export PYTHONPATH=$PWD:$site${PYTHONPATH:+:$PYTHONPATH}
missing=$("$python" -c '
import importlib.util
print(" ".join(m for m in ("tyro", "docstring_parser", "typeguard", "torchdata", "torchao")
               if importlib.util.find_spec(m) is None))')
if [ -n "$missing" ]; then
  ls "$wheels"/*.whl >/dev/null 2>&1 || fail "the image lacks $missing and $wheels/ holds no wheels: run 'bash bench/gpu_wheels.sh' where the network is and carry $wheels with the tree"
  echo "gpu_check: installing $missing from $wheels/ into $site/ (offline, no dependencies)"
  "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --find-links "$wheels" \
    --target "$site" --upgrade $missing \
    || fail "pip could not install $missing from $wheels/ (its message is above): remake it with bench/gpu_wheels.sh"
fi
error=$("$python" -c 'import tyro, torchdata.stateful_dataloader, torchao, meshtrain.cli' 2>&1) \
  || fail "meshtrain does not import on the image's packages: $(echo "$error" | tail -n 1)"
[ "$(versions)" = "$image" ] || fail "the image's packages changed ($image -> $(versions))"
timeout 480 "$python" bench/gpu_check.py "$@"
status=$?
[ $status -ne 124 ] || fail "bench/gpu_check.py ran past 8 minutes (timeout 480 s)"
exit $status
