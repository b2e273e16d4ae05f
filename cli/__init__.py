"""The ``batchrl`` command (``cli.main``): its commands, what a run shows on the console, and the warm command
server with its thin client."""
