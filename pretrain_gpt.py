#!/usr/bin/env python3
"""Pretrain a LLaMA-style GPT with Megatron-style flags.

    python pretrain_gpt.py                       # embedded demo: no download, no flags
    python pretrain_gpt.py --help                # all flags
"""

import sys

from megatron_h2.training.main import main

if __name__ == "__main__":
    sys.exit(main())
