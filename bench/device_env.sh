# Source on the lent GPU machine, from the repo root, to get batchrl's graph there:
#   source bench/device_env.sh [.carry/graph/part-NNN ...]
# takes in the carried parts of the `graph` bundle (bench/carry.py; once all are there it installs them),
# installs the bench wheels of bench/gpu_wheels.sh when `.whl` was carried, makes this checkout importable
# as `batchrl` and sets PYTHONPATH. Returns non-zero while parts are still missing.
for part in "$@"; do bash bench/carry_assemble.sh graph "$part" || return 1; done
if [[ -d .whl && ! -f /tmp/site/.installed ]]; then
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.installed || return 1
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/batchrl
export PYTHONPATH=/tmp/pkg:/tmp/carry/graph/site:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
[[ -f /tmp/carry/graph/READY ]] || { echo "graph bundle not ready yet"; return 1; }
