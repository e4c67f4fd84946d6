"""Unit tests, one folder per package of megatron_h2 (cross-cutting checks at the top): one
process, no scripts started; ``pytest tests/unit`` is the fast loop."""
