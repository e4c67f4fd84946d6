#!/usr/bin/env python3
"""Convert checkpoints between Hugging Face (Llama, GPT-2) and megatron_h2.

The `megatron-h2-convert-checkpoint` command (code: megatron_h2/commands/convert_checkpoint.py).
"""

import sys

from megatron_h2.commands.convert_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
