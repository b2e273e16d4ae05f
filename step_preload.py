"""What the step processes of a multiprocess run find loaded (``batchrl.step_server``): the server they fork
from imports this module once — the code location, torch and the Dagster instance's storage code, each of which
a step process would otherwise load in its first seconds."""
import os

# several steps' torch threads share the cores: OpenMP threads that spin while they wait took the cores
# from each other (policy and DPO side by side on 2 cores: 10x slower); waiting passively keeps the thread
# counts, hence the numbers, of a run that executes one step at a time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dagster as dg  # noqa: E402
import torch  # noqa: E402,F401  (the model stages' first import)

import batchrl.definitions  # noqa: E402,F401  (the code location the step processes rebuild their job from)

if os.environ.get("DAGSTER_HOME"):
    with dg.DagsterInstance.get():  # opened and closed: storage modules imported, schema checked
        pass
