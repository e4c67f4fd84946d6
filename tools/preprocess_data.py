#!/usr/bin/env python3
"""Tokenize a jsonl corpus into Megatron .bin/.idx files.

The `megatron-h2-preprocess-data` command (code: megatron_h2/commands/preprocess_data.py).
"""

import sys

from megatron_h2.commands.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
