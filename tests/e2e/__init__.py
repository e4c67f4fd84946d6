"""End-to-end tests: multi-process runs (gloo groups, torchrun), scripts and tools started as
processes, and long exhaustive comparisons. Each is marked ``e2e`` (tests/e2e/conftest.py)."""
