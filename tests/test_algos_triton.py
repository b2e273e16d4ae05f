"""Runs tests/triton_interpreter_checks.py in a fresh process with Triton's CPU interpreter on (the
flag must be set before triton is first imported, which other tests do)."""
import os
import subprocess
import sys


def test_triton_logprob_kernels_in_the_interpreter():
    checks = os.path.join(os.path.dirname(__file__), "triton_interpreter_checks.py")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", checks],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "6 passed" in done.stdout, done.stdout[-2000:]
