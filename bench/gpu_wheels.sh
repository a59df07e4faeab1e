#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on the lent GPU machine, made here where the network is: what its
# image lacks (tyro and its two dependencies, torchdata, torchao), at the versions CI pins
# (launch/constraints.txt; torchao 0.18 needs torch >= 2.11, the image's), for the image's Python 3.12 on
# manylinux x86_64. They land in .whl/ (about 4 MB), which travels with the tree: run(carry=[".whl"]).
#   bash bench/gpu_wheels.sh [DIR] [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
python_version=${2:-3.12}
wanted=(tyro docstring_parser typeguard torchdata torchao)
pins=()
for name in "${wanted[@]}"; do
  pin=$(grep -i "^${name}==" launch/constraints.txt) || { echo "gpu_wheels: $name is not pinned in launch/constraints.txt" >&2; exit 2; }
  pins+=("$pin")
done
mkdir -p "$dest"
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d "$dest" \
  --python-version "$python_version" --implementation cp --abi "cp${python_version/./}" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any "${pins[@]}"

echo "gpu_wheels: $(ls "$dest" | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest"
