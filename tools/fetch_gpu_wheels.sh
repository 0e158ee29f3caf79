#!/usr/bin/env bash
# Downloads, into .whl/, the wheels an offline GPU machine needs for
# `tools/bench_train.py --baseline torchtitan`: torchtitan 0.2.2 (the release that runs on
# torch 2.11) and the packages its import needs beyond a CUDA PyTorch image that already holds
# pandas, pyarrow, tensorboard, transformers and huggingface_hub; and torchao 0.18.0 (the float8
# extra's floor, which the GPU image lacks) for `[quantize] linear = "float8_*"` and
# first-contact's train_1b7_fp8 step. Run it where pip can reach PyPI;
# tools/gpu_acceptance.sh installs .whl/*.whl on the GPU machine when the folder is there.
#
#   tools/fetch_gpu_wheels.sh [PYTHON_VERSION]     # default 3.12, the GPU image's Python
set -euo pipefail
cd "$(dirname "$0")/.."

python_version="${1:-3.12}"
packages=(
  torchtitan==0.2.2
  torchdata==0.11.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  tyro==1.0.17
  docstring_parser==0.18.0
  typeguard==4.6.0
  shtab==1.13.0
  torchao==0.18.0
)
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d .whl "${packages[@]}"
ls -l .whl
