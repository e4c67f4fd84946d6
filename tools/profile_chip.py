#!/usr/bin/env python3
"""Profile this machine's chip for the planner.

The `megatron-h2-profile-chip` command (code: megatron_h2/commands/profile_chip.py).
"""

import sys

from megatron_h2.commands.profile_chip import main

if __name__ == "__main__":
    sys.exit(main())
