#!/usr/bin/env bash
# The tool task's GRPO bench (bench_gpu_agent.py) on the GPU host at the bwrap level (issue 51), one device call:
# the graph bundle's last part and the sandbox bundle carried here (the first two graph parts by earlier calls:
# bash bench/carry_assemble.sh graph .carry/graph/part-00K), bubblewrap found through BATCHRL_BWRAP.
#   carry: [".carry/graph/part-002", ".carry/sandbox/part-000"]
#   bash bench/agent_sandbox_device.sh [MINUTES] [BUDGET_MINUTES]
set -euo pipefail
minutes=${1:-2} budget=${2:-9.5}
set --  # device_env.sh reads its own arguments
bash bench/carry_assemble.sh graph .carry/graph/part-002 | tail -1
bash bench/carry_assemble.sh sandbox .carry/sandbox/part-000 | tail -1
files=/tmp/carry/sandbox/files
(cd "$files" && sha256sum -c bwrap.sha256) && chmod +x "$files/bwrap"
ldconfig -p | grep -q 'libseccomp.so.2 ' || export LD_LIBRARY_PATH=$files
source bench/device_env.sh
export BATCHRL_BWRAP=$files/bwrap PYTHONPATH=$PYTHONPATH:/tmp/carry/sandbox/site
python3 bench/bench_gpu_agent.py --out "${OUT:-/tmp/out}" --minutes "$minutes" --budget-minutes "$budget" 2>&1 | tail -30
