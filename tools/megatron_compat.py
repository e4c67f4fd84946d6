#!/usr/bin/env python3
"""Write docs/megatron_compat.md: what pretrain_gpt.py does with each Megatron-LM flag.

The `megatron-h2-megatron-compat` command (code: megatron_h2/commands/megatron_compat.py).
"""

import sys

from megatron_h2.commands.megatron_compat import main

if __name__ == "__main__":
    sys.exit(main())
