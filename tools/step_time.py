#!/usr/bin/env python3
"""Predicted vs measured step time of a run.

The `megatron-h2-step-time` command (code: megatron_h2/commands/step_time.py).
"""

import sys

from megatron_h2.commands.step_time import main

if __name__ == "__main__":
    sys.exit(main())
