#!/usr/bin/env bash
# Wheels for bench/bench_gpu_dpo.py and bench/bench_gpu_scale.py on the lent GPU machine (it has torch/transformers/accelerate but
# no deepspeed, trl, datasets or pydantic, and no network). Fills ./.whl (git-ignored through
# .git/info/exclude); pass `carry: [".whl"]` to the device tool and install there with
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# Target: CPython 3.12 on x86-64 Linux.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dest=.whl
mkdir -p "$dest" .git/info
grep -qxF "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude
target=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
pins=(
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19             # TRL DPOTrainer
  peft==0.21.2                                                              # LoRA (batchrl and TRL), pure python
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection  # batchrl config + deepspeed
  typing-extensions hjson                                                  # deepspeed needs
)
python3 -m pip download -q --no-deps "${target[@]}" -d "$dest" "${pins[@]}"
# deepspeed is sdist-only on PyPI: build a pure-Python wheel here (ops are JIT-built, none are used)
python3 -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$dest" 2>/dev/null \
  || python3 -m pip wheel -q --no-deps deepspeed==0.19.8 -w "$dest"
du -sh "$dest"; ls "$dest"
