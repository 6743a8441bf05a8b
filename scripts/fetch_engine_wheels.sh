#!/usr/bin/env bash
# Downloads, here, the engine wheels a GPU session carries (the device reaches no package index): the released SGLang
# whose Triton kernels the engines layer calls, the FlashInfer it pins with FlashInfer's FFI, and SGLang's import-time
# dependencies that the device's image lacks. Into .whl/engines (ignored by git); the GPU step `engines`
# of scripts/gpu_session.sh installs them there with --no-index --no-deps. usage: scripts/fetch_engine_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl/engines
mkdir -p "$dest"
# The device runs Python 3.12 on x86_64 Linux. Besides the engines: what SGLang's kernel modules import (its utilities
# pull in the serving stack) that the device's image lacks, at the versions that import together here
# (tests/engines/test_engines.py runs them in CI); the image has torch, torchvision, aiohttp, requests, pillow, tqdm,
# psutil.
python3 -m pip download -q --no-deps -d "$dest" --python-version 3.12 --platform manylinux2014_x86_64 \
  --only-binary=:all: sglang==0.5.10.post1 flashinfer-python==0.6.7.post3 apache-tvm-ffi pybase64 starlette \
  ipython==8.12.3 asttokens==3.0.1 backcall==0.2.0 decorator==5.2.1 executing==2.2.1 jedi==0.20.0 parso==0.8.7 \
  pexpect==4.8.0 pickleshare==0.7.5 prompt_toolkit==3.0.52 ptyprocess==0.7.0 pure_eval==0.2.3 stack-data==0.6.3 \
  traitlets==5.15.0 wcwidth==0.7.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 \
  typing-inspection==0.4.2 orjson sniffio==1.3.1
# SGLang's fused-MoE Triton module imports its serving stack; what the image lacks of it (pyzmq's wheel wants
# manylinux_2_26), and the transformers SGLang pins with its hub and tokenizers (15 MB of the 18: drop those three
# where the image's transformers imports sglang.srt.utils.hf_transformers_utils)
python3 -m pip download -q --no-deps -d "$dest" --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --only-binary=:all: pyzmq==27.3.0 openai==2.6.1 distro==1.9.0 \
  partial-json-parser==0.2.1.1.post7 dill==0.4.1 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 \
  msgspec==0.23.0 transformers==5.3.0 tokenizers==0.22.2 huggingface_hub==1.33.0
ls -la "$dest"
