#!/usr/bin/env bash
# Stage the peers' wheels for the GPU machine (Python 3.12, x86_64, no network):
#
#   specserve/bench/peers_stage.sh [ENGINE...]      (run in the repository root; default: specserve vllm sglang)
#
# 1. pip-downloads, without dependencies, the pinned wheels of specserve/bench/peers_wheels/<engine>.txt
#    into .peers_wheels/<engine>/ (git-ignored through .git/info/exclude);
# 2. vllm: builds arctic-inference's wheel (suffix decoding; PyPI has only its sdist) with Python 3.12;
# 3. packs vllm and sglang into .peers_wheels/<engine>.tar for scripts/split_for_device.sh, which
#    rebuilds them in /root/models/, where `python -m specserve.bench.peers run` looks for them;
#    .peers_wheels/specserve (a few MB) travels as a `carry` path;
# 4. prints the sizes and the split-for-device command.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
engines=("$@"); [ ${#engines[@]} -gt 0 ] || engines=(specserve vllm sglang)
PIP=${PIP:-.venv/bin/python -m pip}
if [ -z "${PYTHON312:-}" ]; then   # the extension is built for the GPU machine's Python 3.12
  for candidate in python3.12 /root/.pyenv/versions/3.12*/bin/python; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then PYTHON312=$candidate; break; fi
  done
fi
[ -n "${PYTHON312:-}" ] || { echo "no Python 3.12 here: set PYTHON312=/path/to/python3.12" >&2; exit 1; }
grep -qxF '/.peers_wheels/' .git/info/exclude 2>/dev/null || echo '/.peers_wheels/' >> .git/info/exclude
platforms=(); for x in $(seq 35 -1 17); do platforms+=(--platform "manylinux_2_${x}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)

build_arctic() {   # $1: destination folder
  local work; work=$(mktemp -d)
  # setup.py imports torch only to hand its CMake path to the build, which the suffix-tree extension
  # (C++ and nanobind, no CUDA) does not use: a stub stands in for a 3 GB CUDA torch
  mkdir -p "$work/stub/torch/utils"
  printf 'from . import utils, cuda\n' > "$work/stub/torch/__init__.py"
  printf 'cmake_prefix_path = ""\n' > "$work/stub/torch/utils/__init__.py"
  printf 'def is_available():\n    return False\n' > "$work/stub/torch/cuda.py"
  "$PYTHON312" -m pip install --quiet --target "$work/build-deps" setuptools wheel ninja "cmake>=3.18" \
    nanobind==2.9.2 protobuf==5.29.6 grpcio-tools
  PATH="$work/build-deps/bin:$PATH" PYTHONPATH="$work/stub:$work/build-deps" CMAKE_ARGS="-DPython_EXECUTABLE=$PYTHON312" \
    "$PYTHON312" -m pip wheel --quiet --no-deps --no-build-isolation --no-binary :all: -w "$1" arctic-inference==0.3.0
  rm -rf "$work"
}

for engine in "${engines[@]}"; do
  dest=.peers_wheels/$engine
  rm -rf "$dest"; mkdir -p "$dest"
  $PIP download --quiet --no-deps --only-binary :all: --python-version 3.12 "${platforms[@]}" \
    -d "$dest" -r "specserve/bench/peers_wheels/$engine.txt"
  [ "$engine" = vllm ] && build_arctic "$dest"
  if [ "$engine" != specserve ]; then
    tar -cf ".peers_wheels/$engine.tar" -C "$dest" .
  fi
  echo "$engine: $(ls "$dest"/*.whl | wc -l) wheels, $(du -sm "$dest" | cut -f1) MiB"
done
tars=(); for engine in "${engines[@]}"; do [ -f ".peers_wheels/$engine.tar" ] && tars+=(".peers_wheels/$engine.tar"); done
echo
echo "Stage with (models too, if /root/models lacks them; each piece is one device run call):"
echo "  scripts/split_for_device.sh ${tars[*]} [models/qwen2.5-coder-0.5b-instruct.gguf models/qwen2.5-coder-1.5b-instruct.gguf]"
echo "then run, carrying .peers_wheels/specserve, .gpu and .whl:"
echo "  python3 -m specserve.bench.peers run --quick --out \$OUT   [--models M... --engines E...]"
