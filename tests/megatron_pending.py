"""PENDING: Megatron flags that the precision, performance and logging work implements, so they
are still "unknown" (or refused) on this branch.

docs/megatron_compat.md shows them as they are; tests/test_megatron_compat.py requires every
other listed flag to be classified, and fails on a flag of PENDING that has become supported or
accepted (remove it from here then and regenerate the document with
``python tools/megatron_compat.py --write``); tests/test_megatron_scripts.py skips the command
lines that pass one of them with the reason "needs <flags>". When the list is empty, delete this
file and its uses.
"""

from __future__ import annotations

PENDING: frozenset[str] = frozenset({
    "--first-last-layers-bf16",  # FP8 only: neither an effect nor a refusal decided yet
})
