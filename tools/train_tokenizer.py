#!/usr/bin/env python3
"""Train a byte-fallback SentencePiece tokenizer on jsonl or text files.

The `megatron-h2-train-tokenizer` command (code: megatron_h2/commands/train_tokenizer.py).
"""

import sys

from megatron_h2.commands.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
