"""The command-line tools behind ``tools/`` and the ``megatron-h2-*`` entry points."""
