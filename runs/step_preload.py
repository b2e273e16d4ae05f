"""What the step processes of a multiprocess run find loaded (``batchrl.runs.step_server``): the server they fork
from imports this module once — the code location, torch where the steps run models themselves, the Dagster
instance's storage code and its migration scripts, each of which a step process would otherwise load in its
first seconds. It reads and writes nothing of the instance."""
import os
import sys
import time

_IMPORT_STARTED = time.time()
# several steps' torch threads share the cores: OpenMP threads that spin while they wait took the cores
# from each other (policy and DPO side by side on 2 cores: 10x slower); waiting passively keeps the thread
# counts, hence the numbers, of a run that executes one step at a time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import batchrl.definitions  # noqa: E402  (the code location the step processes rebuild their job from)
from batchrl.runs import step_server  # noqa: E402

if step_server.steps_run_models(batchrl.definitions.defs):
    import torch  # noqa: F401  (the in-process model stages' first import)

# the instance's storage code, imported but not opened: opening a fresh home creates its tables, and the run's
# own process creates them at the same time (CI: "table jobs already exists"); steps open it once it exists
import importlib  # noqa: E402

import alembic.runtime.migration  # noqa: E402,F401

from batchrl.common.dagster_internals import STORAGE_MODULES  # noqa: E402
from batchrl.runs import alembic_scripts  # noqa: E402

for _module in STORAGE_MODULES:
    importlib.import_module(_module)

alembic_scripts.warm()  # the migration scripts, read once here for every step's revision checks

import gc  # noqa: E402

gc.freeze()  # what was preloaded is never garbage: the step processes' collections skip it (and leave its pages shared)

# when the first step could fork: a step of a run that reaches its steps sooner waits for this line's time
_ready = time.time()
_forked = "; forked from the warm server" if step_server.forked_from_warm_server() else ""
print(f"batchrl step server: preloaded in {_ready - _IMPORT_STARTED:.2f} s, ready "
      f"{_ready - float(os.environ.get(step_server.STARTED_ENV, _IMPORT_STARTED)):.2f} s after start (at "
      f"{_ready:.3f}){_forked}", file=sys.stderr, flush=True)
