#!/usr/bin/env bash
# meshtrain on another torch of the supported range (2.11 to 2.14), beside CI's pinned 2.13 CPU wheel:
#   launch/check_torch.sh 2.11.0
# builds .venv-torch-VERSION with torch==VERSION from the registry (a CUDA wheel: it runs on CPU once its
# nvidia-* dependencies are installed, ~3 GB), the project's pinned dependencies beside it (never another
# torch), then runs the fast tier and a handful of multi-rank runs: tp2+SP x pp2, cp2, MoE ep2, and
# resume under other layouts (FSDP dp, tp2 x dp2, pp2). For a compatibility check, never for CI.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: launch/check_torch.sh TORCH_VERSION (e.g. 2.11.0)}
venv=.venv-torch-$version
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
installed() { "$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true; }
[ "$(installed)" = "$version" ] || "${pip[@]}" "torch==$version"
"${pip[@]}" -c launch/constraints.txt -c <(echo "torch==$version") -e ".[test]"
echo "torch $(installed) in $venv"
run() { echo "== $*"; "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -n 3; }
status=0
run -m "not slow" tests || status=1
run "tests/test_parallel.py::test_pipeline_layout_equals_single_rank[pp2-tp2-sp]" \
    "tests/test_context_parallel.py::test_cp_layout_equals_single_rank[cp2]" \
    "tests/test_moe.py::test_moe_layout_equals_single_rank[ep2]" \
    "tests/test_checkpoint_parallel.py::test_resume_under_other_layouts_and_bitwise_under_the_same" || status=1
exit $status
