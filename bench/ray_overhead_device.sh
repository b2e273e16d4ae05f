#!/usr/bin/env bash
# bench_ray_overhead.py on the lent GPU (issue 49), one device call, after the graph (3 parts), qwen05 (9 parts,
# bench/gsm8k_device.sh) and ray bundles (`python3 bench/carry.py prepare ray --requirements
# bench/ray_device_wheels.txt`, 2 parts: `bash bench/carry_assemble.sh ray .carry/ray/part-00K`) are assembled.
# carry: [".carry/src", ".carry/gsm8k_data"]  (bash bench/gsm8k_carry.sh --src-only: the committed code)
#   bash bench/ray_overhead_device.sh [ITERATIONS] [ARMS]
set -euo pipefail
mkdir -p /tmp/pkgroot "${OUT:=/tmp/out}" && ln -sfn "$PWD/.carry/src" /tmp/pkgroot/batchrl
site=/tmp/carry/graph/site:/tmp/carry/ray/site:/tmp/carry/qwen05/site
mkdir -p /tmp/pybin && ln -sfn "$(command -v python3)" /tmp/pybin/python  # the Ray jobs' entry point: `python -m`
export PYTHONPATH=/tmp/pkgroot:$site PATH=/tmp/pybin:/tmp/carry/ray/site/bin:/tmp/carry/graph/site/bin:$PATH
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cd .carry/src && python3 bench/bench_ray_overhead.py --out "$OUT" --gsm8k ../gsm8k_data --iterations "${1:-3}" \
  --arms "${2:-one_machine,ray_resident,ray_driver}"
