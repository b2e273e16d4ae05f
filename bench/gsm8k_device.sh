#!/usr/bin/env bash
# The GSM8K arms of bench_gpu_rl_vs_trl.py on the lent GPU, one step per device call (issue 48). From the repo root,
# after `bash bench/gsm8k_carry.sh` (.carry/graph, .carry/qwen05: bundles of bench/carry.py, each part sha256-checked
# by carry_assemble.sh; the GSM8K release in .carry/gsm8k_data; a `git archive HEAD` snapshot in .carry/src: the
# bench runs that committed code, whatever the working tree holds meanwhile):
#   bash bench/gsm8k_device.sh graph K                 # carry: [".carry/graph/part-00K"]
#   bash bench/gsm8k_device.sh qwen K                  # carry: [".carry/qwen05/part-00K"]
#   bash bench/gsm8k_device.sh vllm K                  # carry: [".carry/vllm/part-00K"]: for the vllm_* and trl_vllm arms
#   bash bench/gsm8k_device.sh qwen15 K                # carry: [".carry/qwen15/part-NNN"]: the 1.5B, for
#                                                      #   BENCH_ARGS="--gsm8k-profile gsm8k-1.5b" (or gsm8k-1.5b-lora)
#   bash bench/gsm8k_device.sh bench PARTS [MIN] [K]   # carry: [".carry/src", ".carry/gsm8k_data"]; PARTS as the bench's
# `bench` refuses a .carry/src that differs from this checkout's code: commit, then `gsm8k_carry.sh --src-only`.
# Device time at 1.5B (H100, 2026-12-06): carries ~185 s, prep ~95 s an arm (a later arm now links the first's
# conversion: seconds on the CPU at 0.5B, not yet timed on the device), an 8-minute arm ~530 s, eval 25-41 s a model,
# export:ARM ~235 s; a full 1.5B checkpoint is 7.1 GB.
set -uo pipefail
SOURCES="assets bench cli common ingest lineage profiles resources runs schemas training definitions.py"
step=$1; shift
case $step in
  graph) bash bench/carry_assemble.sh graph ".carry/graph/part-$(printf %03d "$1")" ;;
  qwen) bash bench/carry_assemble.sh qwen05 ".carry/qwen05/part-$(printf %03d "$1")" ;;
  qwen15) bash bench/carry_assemble.sh qwen15 ".carry/qwen15/part-$(printf %03d "$1")" ;;
  vllm) bash bench/carry_assemble.sh vllm ".carry/vllm/part-$(printf %03d "$1")" ;;
  bench)
    # the snapshot must be this checkout's code: a stale .carry/src ran a session's 1.5B arms on old bench code
    stale=$(for d in $SOURCES; do diff -rq -x __pycache__ -x '*.pyc' -x results -x '*.md' "$d" ".carry/src/$d" 2>&1; done |
            head -5)
    if [[ -n $stale && ${BENCH_ANY_SRC:-0} != 1 ]]; then
      printf 'refused: .carry/src (commit %s) is not this checkout:\n%s\ncommit, then bash bench/gsm8k_carry.sh ' \
        "$(cat .carry/src/SOURCE_COMMIT 2>/dev/null || echo unknown)" "$stale" >&2
      echo '--src-only (or BENCH_ANY_SRC=1 to run the snapshot anyway)' >&2; exit 3
    fi
    echo "code: $(cat .carry/src/SOURCE_COMMIT 2>/dev/null || echo unknown)"
    mkdir -p /tmp/pkgroot "${OUT:=/tmp/out}" && ln -sfn "$PWD/.carry/src" /tmp/pkgroot/batchrl
    export PYTHONPATH=/tmp/pkgroot:/tmp/carry/graph/site:/tmp/carry/qwen05/site:/tmp/carry/qwen15/site
    export PATH=/tmp/carry/graph/site/bin:$PATH
    [[ -d /tmp/carry/vllm/site ]] && export PYTHONPATH=$PYTHONPATH:/tmp/carry/vllm/site  # after graph: its pins win
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    cd .carry/src && python3 bench/bench_gpu_rl_vs_trl.py --task gsm8k --gsm8k ../gsm8k_data --parts "$1" \
      --minutes "${2:-8}" --curve-every "${3:-4}" --state /tmp/gsm8k_state --out "$OUT" ${BENCH_ARGS:-} ;;
  *) echo "usage: $0 graph K | qwen K | qwen15 K | vllm K | bench PARTS [MINUTES] [CURVE_EVERY]" >&2; exit 2 ;;
esac
