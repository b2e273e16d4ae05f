#!/usr/bin/env bash
# The real-model learning run on the lent GPU (issue: a real pretrained LLM end to end).
# Carry the `graph` bundle first (bench/carry.py prepare graph; one part per device call with
# bench/carry_assemble.sh), then in the call that carries the last part:
#   bash bench/carry_assemble.sh graph .carry/graph/part-002 && bash bench/bench_gpu_real.sh [MINUTES]
# Runs `batchrl run --profile real` with BATCHRL_ENV=gpu (transformers rollouts on CUDA where vLLM is
# absent, DeepSpeed in bf16 through Pipes), on-policy iterations until MINUTES (default 6) have passed,
# then the evaluation; writes $OUT/real_run.json, $OUT/run.log and the policy's chat answers.
set -uo pipefail
MINUTES=${1:-6}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/pkgroot
ln -sfn "$PWD" /tmp/pkgroot/batchrl
export PYTHONPATH=/tmp/pkgroot:/tmp/carry/graph/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/carry/graph/site/bin:$PATH
export BATCHRL_ENV=gpu BATCHRL_STORAGE=/tmp/batchrl-real/storage DAGSTER_HOME=/tmp/batchrl-real/home
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
( while sleep 2; do nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader; done ) \
  > "$OUT/gpu_trace.csv" 2>/dev/null &
TRACE=$!
start=$(date +%s)
timeout $(( ${MINUTES%.*} * 60 + 120 )) python3 -c "import sys; from batchrl.cli.main import console_main; console_main(sys.argv[1:])" \
  run --profile real --rl-iterations 50 --max-minutes "$MINUTES" > "$OUT/run.log" 2>&1
echo "batchrl run exit $? after $(( $(date +%s) - start )) s"
kill $TRACE
grep -v " DEBUG " "$OUT/run.log" | grep -E "=== |SUCCESS|FAILED|Error|error" | tail -20
python3 bench/real_run_report.py "$OUT" | tee "$OUT/summary.txt"
python3 - <<'PY' | tee "$OUT/chat.txt"
# The trained policy loads with plain transformers and chats.
import json, os, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
run = json.load(open(os.path.join(os.environ.get("OUT", "/tmp/out"), "real_run.json")))
import dagster as dg
with dg.DagsterInstance.get() as inst:
    uri = inst.get_latest_materialization_event(dg.AssetKey("policy_checkpoint")).asset_materialization.metadata["uri"].value
tok = AutoTokenizer.from_pretrained(uri)
model = AutoModelForCausalLM.from_pretrained(uri, dtype=torch.bfloat16).cuda()
for q in ["What is 23 + 48? Answer with a number.", "Tom has 3 boxes with 6 pens each. He gives away 4 pens. How many pens does he have? Give the final answer as a number after ####.", "Write one sentence about the sea."]:
    ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"].cuda()
    out = model.generate(ids, max_new_tokens=48, do_sample=False)
    print(uri, "|", q, "->", repr(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
PY
