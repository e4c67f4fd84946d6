#!/usr/bin/env python3
"""Operator precision alignment of one training step against a reference.

The `megatron-h2-precision-check` command (code: megatron_h2/commands/precision_check.py).
"""

import sys

from megatron_h2.commands.precision_check import main

if __name__ == "__main__":
    sys.exit(main())
