"""``python -m batchrl.cli``: the ``batchrl`` command."""
from batchrl.cli.main import console_main

console_main()
