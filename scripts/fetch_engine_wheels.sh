#!/usr/bin/env bash
# Downloads, here, the engine wheels a GPU session carries (the device reaches no package index): the released SGLang
# whose Triton kernels the engines layer calls, the FlashInfer it pins with FlashInfer's FFI, and the two of SGLang's
# import-time dependencies that the device's image lacks. Into .whl/engines (ignored by git); the GPU step `engines`
# of scripts/gpu_session.sh installs them there with --no-index --no-deps. usage: scripts/fetch_engine_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl/engines
mkdir -p "$dest"
# the device runs Python 3.12 on x86_64 Linux
python3 -m pip download -q --no-deps -d "$dest" --python-version 3.12 --platform manylinux2014_x86_64 \
  --only-binary=:all: sglang==0.5.10.post1 flashinfer-python==0.6.7.post3 apache-tvm-ffi pybase64 starlette
ls -la "$dest"
