#!/usr/bin/env bash
# The sandbox on the GPU host, one device call (carry: [".carry/sandbox/part-000"], made by bench/sandbox_bundle.py):
# the bundle's bubblewrap (sha256-checked) found through BATCHRL_BWRAP, the levels probed, the escape suite run at
# every level that works there, the load bench (16 concurrent trajectories, replay vs persistent) at bwrap and
# namespaces. Writes $OUT/sandbox_gpu/{levels.json,escape.xml,escape.txt,load_*.json}.
# NOT RUN in the session that wrote it (2026-12-05: the GPU host could not be used): run it and record the outcome
# in docs/RELIABILITY.md ("The sandbox, per level and host") and bench/RESULTS.md.
set -euo pipefail
out=${OUT:-/tmp/out}/sandbox_gpu
mkdir -p "$out"
bash bench/carry_assemble.sh sandbox .carry/sandbox/part-000
files=/tmp/carry/sandbox/files
(cd "$files" && sha256sum -c bwrap.sha256)
chmod +x "$files/bwrap"
export BATCHRL_BWRAP=$files/bwrap
command -v bwrap >/dev/null && echo "this host has its own bwrap: $(command -v bwrap)" || echo "no bwrap installed here"
ldconfig -p | grep -q 'libseccomp.so.2 ' || export LD_LIBRARY_PATH=$files
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/batchrl
export PYTHONPATH=/tmp/pkg:/tmp/carry/sandbox/site PYTHONUNBUFFERED=1
python3 - "$out/levels.json" <<'PY'
import json, sys
from batchrl.training import sandbox
report = {level: sandbox.probe(level) for level in sandbox.LEVELS}
report["chosen"] = sandbox.describe(sandbox.isolation_level())
json.dump(report, open(sys.argv[1], "w"), indent=1)
print(json.dumps(report, indent=1))
PY
# the escape suite as CI runs it, without the repo's conftest and xdist (neither travels)
python3 -m pytest -q --noconftest -o addopts= -p no:cacheprovider --junitxml="$out/escape.xml" \
  tests/test_sandbox_escape.py 2>&1 | tee "$out/escape.txt" | tail -20
for level in bwrap namespaces; do
  python3 bench/bench_sandbox_load.py --level "$level" --out "$out/load_$level.json" >/dev/null && \
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['speedup_sandbox_s'], r['replay'], r['persistent'])" "$out/load_$level.json" "$level"
done
