"""The test suite: ``unit/`` mirrors the packages of megatron_h2 (the fast loop), ``e2e/``
starts processes or runs long exhaustive comparisons, ``helpers/`` is what both share."""
