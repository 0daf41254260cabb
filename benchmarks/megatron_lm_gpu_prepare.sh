#!/usr/bin/env bash
# Prepares what benchmarks/megatron_lm_gpu.py needs on a GPU machine that has no network:
#   benchmarks/megatron_lm_gpu_prepare.sh [MEGATRON_LM_GIT] [OUT_DIR]
# MEGATRON_LM_GIT: a clone (or mirror) of github.com/NVIDIA/Megatron-LM holding the tag of the
# megatron-core in use (default: clone it). Writes OUT_DIR/mlm (the tag's pretrain_gpt.py, its
# builders and megatron/, with the dataset helper megatron-core's wheel ships, built from the same
# source) and OUT_DIR/whl (megatron-core and the packages Megatron-LM's training code imports that a
# plain CUDA PyTorch image may lack: pydantic and its parts, six, regex, PyYAML, packaging, tqdm;
# and pybind11, which building shm_tensor_rdma there needs). OUT_DIR defaults to the repository
# root's .gpu/, which .git/info/exclude should ignore.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${2:-$root/.gpu}
python=${PYTHON:-python3}
version=$($python -c "import importlib.metadata as m; print(m.version('megatron-core'))" 2>/dev/null || echo 0.16.1)
tag=core_v$version
src=${1:-}
if [[ -z $src ]]; then
  src=$(mktemp -d)/Megatron-LM
  git clone --quiet --depth 1 --branch "$tag" https://github.com/NVIDIA/Megatron-LM "$src"
fi
git -C "$src" rev-parse --verify --quiet "$tag^{commit}" >/dev/null \
  || { echo "error: $src has no tag $tag (the megatron-core in use is $version)" >&2; exit 1; }
rm -rf "$out/mlm" "$out/whl"
mkdir -p "$out/mlm" "$out/whl"
git -C "$src" archive "$tag" pretrain_gpt.py gpt_builders.py model_provider.py megatron | tar -x -C "$out/mlm"
echo "Megatron-LM $tag -> $out/mlm"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
$python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$out/whl" "megatron-core==$version" pydantic pydantic-core annotated-types typing-inspection \
  six regex pyyaml packaging tqdm pybind11
# pydantic names the pydantic-core it needs exactly: fetch that one if the newest differs.
need=$(unzip -p "$out"/whl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
if [[ -n $need ]] && ! ls "$out"/whl/pydantic_core-"$need"-*.whl >/dev/null 2>&1; then
  rm -f "$out"/whl/pydantic_core-*.whl
  $python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$out/whl" "pydantic-core==$need"
fi
unzip -o -j -q "$out"/whl/megatron_core-*.whl 'megatron/core/datasets/helpers_cpp.cpython-312-*.so' \
  -d "$out/mlm/megatron/core/datasets/"
touch "$out"/mlm/megatron/core/datasets/helpers_cpp*.so  # newer than helpers.cpp: make has nothing to do
ls "$out/whl"
du -sh "$out"
cat <<MSG
On the GPU machine (Python 3.12, CUDA PyTorch), from the repository root:
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $out/whl/*.whl && export PYTHONPATH=/tmp/site
  python3 benchmarks/megatron_lm_gpu.py --megatron-lm $out/mlm --out OUT --budget-s 500
MSG
